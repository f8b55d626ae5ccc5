"""``python -m ds4jax``: the ``ds4jax`` command."""

import sys

from ds4jax.cli import main

sys.exit(main())
