"""Resumable batch generation: ``python scripts/batch_generate.py INPUT.jsonl OUTPUT.jsonl [options]``.

The same as ``ds4jax batch`` (see ``ds4jax batch --help`` and `ds4jax/batch.py`)."""

import sys

from ds4jax.batch import main

if __name__ == "__main__":
    sys.exit(main())
