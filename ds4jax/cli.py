"""The ``ds4jax`` command: ``generate``, ``compare`` and ``info``.

Thin by design: argument parsing and error reporting here, everything else in the package. User errors (a
missing checkpoint, a bad value) print one line and exit with status 2; bugs keep their traceback.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import unicodedata
from typing import Sequence

from ds4jax.errors import Ds4jaxError, UsageError
from ds4jax.io import convert as _convert

USER_ERROR = 2
UserError = UsageError  # the older name

# ---- argument parsing ----------------------------------------------------------------------------------------------

def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _probability(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds4jax", description="DeepSeek-V4 inference in JAX.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate a continuation of a prompt",
                         description="Generate text. Without --checkpoint, runs the default model (checkpoints/default: "
                                     "a small DeepSeek-V4 trained on the Python standard library).")
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory (default: checkpoints/default)")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=32, metavar="N")
    gen.add_argument("--temperature", type=_non_negative_float, default=0.0, metavar="T", help="0 = greedy")
    gen.add_argument("--top-p", type=_probability, default=1.0, metavar="P")
    gen.add_argument("--seed", type=int, default=0, metavar="S")
    gen.add_argument("--prefill-chunk", type=_positive_int, default=None, metavar="C",
                     help="prefill the prompt in chunks of C tokens (default: one chunk)")
    gen.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                     help="compute dtype (default: bfloat16 for a checkpoint, float32 for the default model)")
    gen.add_argument("--speculative", type=_positive_int, default=None, metavar="K",
                     help="speculative decoding: the checkpoint's MTP block drafts K tokens per round "
                          "(greedy output is identical to plain decoding); prints acceptance stats to stderr")

    cmp = sub.add_parser("compare", help="compare ds4jax with HF transformers on a checkpoint (fp32, CPU)",
                         description="Run HF transformers' DeepseekV4ForCausalLM and ds4jax on the same random "
                                     "tokens; print logit and per-layer errors; exit 1 above --tol.")
    cmp.add_argument("--checkpoint", metavar="DIR", required=True)
    cmp.add_argument("--seq-len", type=_positive_int, default=64, metavar="N")
    cmp.add_argument("--batch", type=_positive_int, default=2, metavar="B")
    cmp.add_argument("--tol", type=_positive_float, default=1e-5, metavar="X", help="max relative error")
    cmp.add_argument("--seed", type=int, default=0, metavar="S")

    info = sub.add_parser("info", help="print a config summary and parameter counts (reads no weights)")
    which = info.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint", metavar="DIR")
    which.add_argument("--preset", choices=("default", "tiny", "flash", "pro"))
    _convert.add_parser(sub)
    return parser


# ---- commands ------------------------------------------------------------------------------------------------------

def _require_checkpoint(path: str) -> str:
    if not os.path.isdir(path):
        raise UserError(f"checkpoint directory {path!r} does not exist")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise UserError(f"{path!r} has no config.json; is it a checkpoint directory?")
    return path


def _load(args):
    """(model, tokenizer) for `generate`."""
    import jax.numpy as jnp

    from ds4jax.io import checkpoint
    from ds4jax.io.default_model import default_model, default_tokenizer
    from ds4jax.io.tokenizer import load_tokenizer

    if args.checkpoint is None:
        return default_model(jnp.dtype(args.dtype or "float32")), default_tokenizer()
    path = _require_checkpoint(args.checkpoint)
    model = checkpoint.load(path, dtype=jnp.dtype(args.dtype or "bfloat16"))
    return model, load_tokenizer(path, model.config.vocab_size)


def _generate(args) -> int:
    from ds4jax.generation.generate import SamplingParams, generate

    model, tok = _load(args)
    print(f"[{tok.note}]", file=sys.stderr)
    ids = tok.encode(args.prompt, add_bos=True)
    if not ids:
        raise UserError("the prompt encodes to no tokens (and the tokenizer has no BOS)")
    if max(ids) >= model.config.vocab_size:
        raise UserError(f"the tokenizer produced id {max(ids)}, outside the model's vocabulary "
                        f"({model.config.vocab_size})")
    if len(ids) + args.max_new_tokens > model.config.max_position_embeddings:
        raise UserError(f"prompt ({len(ids)} tokens) + --max-new-tokens exceeds the model's "
                        f"max_position_embeddings ({model.config.max_position_embeddings})")
    stop = () if tok.eos_id is None else (tok.eos_id,)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                              seed=args.seed, stop_ids=stop)
    if args.speculative:
        from ds4jax.generation.speculative import speculative_generate

        if not model.has_mtp:
            raise UserError("--speculative needs the MTP block, and this checkpoint has no mtp.* tensors")
        result = speculative_generate(model, ids, sampling, k=args.speculative, prefill_chunk=args.prefill_chunk)
        new = result.tokens[0]
        print(f"[speculative k={args.speculative}: {result.rounds[0]} rounds, mean accepted "
              f"{result.mean_accepted[0]:.2f} of {args.speculative} drafts per round, "
              f"{result.seconds:.1f} s including compilation]", file=sys.stderr)
    else:
        new = generate(model, ids, sampling, prefill_chunk=args.prefill_chunk)[0]
    if new and new[-1] in stop:
        new = new[:-1]
    print(printable(tok.decode(new)))
    return 0


def printable(text: str) -> str:
    """Escape control characters (a random model emits ESC and friends) so they cannot drive the terminal."""
    keep = "\n\t"
    return "".join(c if c in keep or unicodedata.category(c)[0] != "C" else c.encode("unicode_escape").decode()
                   for c in text)


def enable_compilation_cache() -> None:
    """Persist compiled programs across runs (the first ``generate`` compiles for about a minute on CPU).

    ``DS4JAX_COMPILATION_CACHE`` overrides the directory (``off`` disables); an explicit JAX setting wins."""
    import jax

    where = os.environ.get("DS4JAX_COMPILATION_CACHE")
    if where == "off" or os.environ.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir:
        return
    if not where:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        where = os.path.join(base, "ds4jax", "jax")
    jax.config.update("jax_compilation_cache_dir", where)


def _compare(args) -> int:
    from ds4jax.compare import run_compare

    path = _require_checkpoint(args.checkpoint)
    try:
        report = run_compare(path, seq_len=args.seq_len, batch=args.batch, tol=args.tol, seed=args.seed)
    except ImportError as e:  # torch / transformers missing: an environment problem, not a failed comparison
        raise UserError(str(e)) from None
    return 0 if report.ok else 1


def _info(args) -> int:
    from ds4jax.model import config as _config
    from ds4jax.io.default_model import default_config

    if args.checkpoint is not None:
        cfg, name = _config.load_config(_require_checkpoint(args.checkpoint)), args.checkpoint
    else:
        cfg, name = (default_config() if args.preset == "default" else _config.PRESETS[args.preset]()), args.preset
    print(describe(cfg, name))
    return 0


def describe(cfg, name: str) -> str:
    """Config summary plus parameter counts from the abstract parameter tree (nothing is allocated)."""
    import jax
    import jax.numpy as jnp

    from ds4jax.model import params as _params

    tree = _params.abstract(cfg, jnp.bfloat16)
    size = lambda t: sum(math.prod(x.shape) for x in jax.tree.leaves(t))
    mtp = size(tree.pop("mtp", {}))
    total = size(tree)
    routed = sum(size(layer["ffn"]["experts"]) for layer in tree["layers"])
    # active per token: everything but the routed experts a token does not use (embedding and head included)
    active = total - routed + routed * cfg.num_experts_per_tok // cfg.num_routed_experts
    codes = lambda seq: "".join(t.name[0] for t in seq)  # one letter per layer keeps Flash/Pro on one line
    y = cfg.yarn
    yarn = "off" if y is None else f"factor {y.factor:g}, original {y.original_max_position_embeddings}"
    lines = [
        f"{name}: DeepSeek-V4, {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}",
        f"  attention   {codes(cfg.attention_types)} (S sliding, C CSA, H HCA)",
        f"              {cfg.num_heads} heads x {cfg.head_dim} (rope {cfg.rope_head_dim}), q_lora {cfg.q_lora_rank}, "
        f"output {cfg.o_groups} groups x {cfg.o_lora_rank}, window {cfg.sliding_window}",
        f"              CSA ratio {cfg.csa_ratio} (indexer {cfg.index_num_heads} x {cfg.index_head_dim}, "
        f"top {cfg.index_topk}), HCA ratio {cfg.hca_ratio}",
        f"  moe         {codes(cfg.mlp_types)} (H hash, T top-k)",
        f"              {cfg.num_routed_experts} experts (top {cfg.num_experts_per_tok}) + {cfg.num_shared_experts} "
        f"shared, ffw {cfg.moe_intermediate_size}, scale {cfg.routed_scaling_factor:g}, "
        f"swiglu limit {cfg.swiglu_limit:g}",
        f"  mHC         {cfg.hc_mult} streams, {cfg.hc_sinkhorn_iters} Sinkhorn iterations",
        f"  rope        theta {cfg.rope_theta:g}, compressed layers {cfg.compress_rope_theta:g} with YaRN {yarn}",
        f"  mtp         {cfg.num_mtp_layers} layer(s)",
        f"parameters    {total:,} (+ {mtp:,} MTP), {active:,} active per token; routed experts {routed:,}",
    ]
    return "\n".join(lines)


COMMANDS = {"generate": _generate, "compare": _compare, "info": _info, "convert": _convert.run}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse has printed usage and the message; return its status instead of exiting
        return int(e.code or 0)
    if args.command in ("generate", "compare"):
        enable_compilation_cache()
    try:
        return COMMANDS[args.command](args)
    except Ds4jaxError as e:
        print(f"ds4jax: error: {e}", file=sys.stderr)
        return e.exit_status


if __name__ == "__main__":
    sys.exit(main())
