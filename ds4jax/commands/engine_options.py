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
    p.add_argument("--adaptive", action="store_true",
                   help="with --speculative K: each call picks 0..K drafts from the batch and the acceptance so far")
    add_lookup_option(p)
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
    add_kv_dtype_option(p)
    add_numerics_option(p)


def add_lookup_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lookup", type=non_negative_int, default=None, metavar="N",
                   help="with --speculative K: a greedy request whose last >= N tokens occurred earlier in its prompt "
                        "or output drafts the K tokens that followed (no draft-model step when every row found one; "
                        "default 3 with --speculative; 0 = off)")


def add_kv_dtype_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-dtype", choices=("auto", "fp8"), default="auto",
                   help="KV cache storage: auto = the model's dtype; fp8 = E4M3 with a scale per row (about twice "
                        "the tokens in the same memory; OCP, or FNUZ on MI300)")


def add_numerics_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--numerics", choices=("reference", "official"), default="reference",
                   help="rounding: reference = HF transformers' numbers; official = the official inference code's "
                        "FP8 / FP4 fake quantisation of KV, indexer and GEMM inputs (docs/official_numerics.md)")


def check_engine_values(args: argparse.Namespace) -> None:
    """Run each integer engine option of `args` through its argparse type, so a Namespace built by hand (a caller
    of `ds4jax.batch.run`) is checked as the command line is: `UsageError` naming the flag."""
    from ds4jax.errors import UsageError

    parser = argparse.ArgumentParser(add_help=False)
    add_engine_options(parser)
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if action.type is None or not action.option_strings or value is None:
            continue
        try:
            if isinstance(value, bool) or not isinstance(value, int):
                if action.type in (positive_int, non_negative_int):
                    raise argparse.ArgumentTypeError(f"must be an integer, got {value!r}")
                continue
            action.type(str(value))
        except argparse.ArgumentTypeError as e:
            raise UsageError(str(e), name=action.option_strings[0], value=value) from None


def add_logprobs_option(p: argparse.ArgumentParser, default: int) -> None:
    """``--max-logprobs`` (serve, and warmup to compile serve's programs); batch builds its engine without them."""
    p.add_argument("--max-logprobs", type=non_negative_int, default=default, metavar="N",
                   help="the engine's programs also return each token's log-probability and N alternatives (0 = "
                        "off; `ds4jax serve` uses 20, OpenAI's cap)")


def build_engine(model, args: argparse.Namespace, tokenizer=None):
    """The `Engine` that `args` (the options above) describe. A value it cannot take (out of range, or not for this
    model: --speculative without an MTP block, pools that cannot be sized) raises `UsageError` naming the flag,
    before any request runs."""
    from ds4jax.errors import InputError, UsageError
    from ds4jax.generation.engine import Engine

    check_engine_values(args)
    try:
        # a Namespace built by hand (older callers of batch.run) may not name --prefill-tokens: its default then
        engine = Engine(model, max_slots=args.max_slots, max_context=args.max_context, speculative=args.speculative,
                        prefill_chunk=args.prefill_chunk, prefill_tokens=getattr(args, "prefill_tokens", None),
                        steps_per_call=args.steps_per_call, tokenizer=tokenizer,
                        adaptive=getattr(args, "adaptive", False), logprobs=getattr(args, "max_logprobs", 0),
                        kv_dtype=getattr(args, "kv_dtype", "auto"), lookup=getattr(args, "lookup", None))
    except InputError as e:  # PoolError / PoolSpecError name the engine argument: report its flag
        flags = {"lookup": "--lookup", "max_slots": "--max-slots", "max_context": "--max-context",
                 "prefill_chunk": "--prefill-chunk", "prefill_tokens": "--prefill-tokens",
                 "steps_per_call": "--steps-per-call", "speculative": "--speculative", "adaptive": "--adaptive"}
        attr = next((a for a in flags if a in str(e)), None)
        where = {} if attr is None else dict(name=flags[attr], value=getattr(args, attr, None))
        raise UsageError(f"the engine cannot be built: {e}", **where) from None
    if engine.layout is None:  # one device runs every step (a mesh splits them)
        _check_step_memory(engine)
    return engine


def _check_step_memory(engine) -> None:
    """The widest prefill call's working memory (a lower bound from the config) against the free memory left once
    the weights and pools are in place: too little is a `DeviceMemoryError` naming the flags, before any step."""
    from ds4jax.model import footprint
    from ds4jax.runtime import memory

    tokens = max(rows * width for rows, width in engine.buckets.prefill)
    memory.check_fits(footprint.step_bytes(engine.cfg, tokens, engine.tspec.dtype),
                      f"a prefill step's working memory ({tokens} tokens: --prefill-tokens, --prefill-chunk; x "
                      f"{footprint.STEP_FIELDS})")
