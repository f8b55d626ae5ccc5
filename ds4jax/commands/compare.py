"""``ds4jax compare``: ds4jax vs HF transformers on a checkpoint. Exit 0 within --tol, 1 above it, 2 when the
checkpoint is bad or torch / transformers are missing."""

from __future__ import annotations

import argparse

from ds4jax.commands.options import HelpFormatter, integer, positive_float, positive_int

NAME = "compare"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(NAME, help="compare ds4jax with HF transformers on a checkpoint (fp32, CPU)",
                       description="Run HF transformers' DeepseekV4ForCausalLM and ds4jax on the same random "
                                   "tokens; print logit and per-layer errors. Exit status 1 when an error is "
                                   "above --tol, 2 when the checkpoint cannot be read.",
                       formatter_class=HelpFormatter)
    p.add_argument("--checkpoint", metavar="DIR", required=True, help="checkpoint directory (config.json + "
                   "*.safetensors)")
    p.add_argument("--seq-len", type=positive_int, default=64, metavar="N", help="tokens per sequence")
    p.add_argument("--batch", type=positive_int, default=2, metavar="B", help="sequences")
    p.add_argument("--tol", type=positive_float, default=1e-5, metavar="X", help="max relative error to pass")
    p.add_argument("--seed", type=integer, default=0, metavar="S", help="seed of the random token ids")
    return p


def run(args) -> int:
    from ds4jax.commands.generate import require_checkpoint
    from ds4jax.compare import run_compare
    from ds4jax.errors import UsageError

    path = require_checkpoint(args.checkpoint)
    try:
        report = run_compare(path, seq_len=args.seq_len, batch=args.batch, tol=args.tol, seed=args.seed)
    except ImportError as e:  # torch / transformers missing: an environment problem, not a failed comparison
        raise UsageError(str(e)) from None
    return 0 if report.ok else 1
