"""Engine settings shared by ``ds4jax batch`` and ``ds4jax warmup``: the same flags build the same `Engine`, so a
warm-up compiles (and caches on disk) exactly the programs a batch job with those flags runs."""

from __future__ import annotations

import argparse

from ds4jax.commands.mesh_options import add_mesh_option
from ds4jax.commands.options import non_negative_int, positive_int


def add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory (default: the embedded model)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="compute dtype (default: bfloat16 for a checkpoint, float32 for the embedded model)")
    p.add_argument("--speculative", type=non_negative_int, default=0, metavar="K",
                   help="MTP drafts per round (0 = off)")
    p.add_argument("--max-slots", type=positive_int, default=8, metavar="B", help="requests decoded together")
    p.add_argument("--max-context", type=positive_int, default=4096, metavar="T",
                   help="prompt + new tokens per request")
    p.add_argument("--prefill-chunk", type=positive_int, default=256, metavar="C",
                   help="most prompt tokens a request takes per prefill step")
    p.add_argument("--prefill-tokens", type=positive_int, default=None, metavar="N",
                   help="most prompt tokens one prefill step takes over all its requests (default: the larger of C "
                        "and 16 x B)")
    p.add_argument("--steps-per-call", type=positive_int, default=8, metavar="M",
                   help="tokens (or speculative rounds) per host round trip")
    add_mesh_option(p)


def build_engine(model, args: argparse.Namespace, tokenizer=None):
    """The `Engine` that `args` (the options above) describe."""
    from ds4jax.generation.engine import Engine

    # a Namespace built by hand (older callers of batch.run) may not name --prefill-tokens: its default then
    return Engine(model, max_slots=args.max_slots, max_context=args.max_context, speculative=args.speculative,
                  prefill_chunk=args.prefill_chunk, prefill_tokens=getattr(args, "prefill_tokens", None),
                  steps_per_call=args.steps_per_call, tokenizer=tokenizer)
