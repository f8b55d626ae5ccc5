"""``ds4jax info``: a config summary and parameter counts, from the config alone (no weights are read); with
``--mesh``, the per-device memory plan of that mesh (params, pools, what is left), also before any weight is read."""

from __future__ import annotations

import argparse
import math
import os

from ds4jax.commands.mesh_options import add_mesh_option
from ds4jax.commands.options import gibibytes, positive_int

NAME = "info"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(NAME, help="print a config summary and parameter counts (reads no weights)",
                       description="Print the architecture and parameter counts of a checkpoint's config.json or "
                                   "of a preset. No weights are read.")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory (its config.json)")
    which.add_argument("--preset", choices=("default", "tiny", "flash", "pro"), help="a built-in configuration")
    add_mesh_option(p)
    plan = p.add_argument_group("memory plan (with --mesh)")
    plan.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16", help="params and pools dtype")
    plan.add_argument("--quantized", choices=("fp8", "fp4"), default=None,
                      help="the params as a checkpoint quantized so holds them on the device (weights=\"checkpoint\"): "
                           "fp4 = FP8 dense linears + FP4 routed experts (DeepSeek-V4 as published), fp8 = both FP8")
    plan.add_argument("--max-slots", type=positive_int, default=8, metavar="B", help="requests decoded together")
    plan.add_argument("--max-context", type=positive_int, default=4096, metavar="T",
                      help="prompt + new tokens per request")
    plan.add_argument("--device-memory", type=gibibytes, default=None, metavar="GIB",
                      help="memory per device in GiB (default: what the device reports; CPU devices report none)")
    plan.add_argument("--devices", type=positive_int, default=None, metavar="N",
                      help="plan for N stand-in devices (forced host CPU devices) instead of the ones present")
    return p


def run(args) -> int:
    from ds4jax.commands.generate import require_checkpoint
    from ds4jax.io.default_model import default_config
    from ds4jax.model import config as _config

    if args.checkpoint is not None:
        cfg, name = _config.load_config(require_checkpoint(args.checkpoint)), args.checkpoint
    else:
        cfg, name = (default_config() if args.preset == "default" else _config.PRESETS[args.preset]()), args.preset
    print(describe(cfg, name))
    if args.mesh is not None:
        print(memory_plan(cfg, args))
    return 0


def memory_plan(cfg, args) -> str:
    """Per-device bytes on the busiest device of --mesh: params, the target pools of --max-slots x --max-context
    (the engine's pool spec), their sum and what the device has left."""
    if args.devices is not None:  # stand-ins: forced host devices, set before jax starts a backend
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.devices}")
    import jax

    from ds4jax.commands.mesh_options import mesh_layout
    from ds4jax.generation.engine import default_page_size
    from ds4jax.runtime.mesh_plan import format_bytes
    from ds4jax.runtime.pool_spec import PoolSpec
    from ds4jax.runtime.roles import Role

    layout = mesh_layout(args, cfg)
    spec = PoolSpec.for_role(cfg, role=Role.TARGET, max_slots=args.max_slots, max_context=args.max_context,
                             page_size=default_page_size(cfg), dtype=args.dtype)
    quantized = getattr(args, "quantized", None)
    report = layout.memory_report(cfg, spec, args.dtype, quantized=quantized)
    if args.device_memory is not None:
        memory, source = int(args.device_memory * 2**30), "--device-memory"
    else:
        stats = jax.devices()[0].memory_stats() or {}
        memory, source = stats.get("bytes_limit"), jax.devices()[0].device_kind
    free = ("unknown (the devices report no memory size: pass --device-memory GIB)" if memory is None else
            f"{format_bytes(memory - report['total'])} of {format_bytes(memory)} ({source})"
            + ("  DOES NOT FIT" if report["total"] > memory else ""))
    return "\n".join([
        f"memory plan   {layout.describe()}, per device (the busiest), {args.dtype}",
        f"  params      {format_bytes(report['params'])}" + (f" ({STORED[quantized]})" if quantized else ""),
        f"  pools       {format_bytes(report['pools'])} (target, {args.max_slots} slots x {args.max_context} tokens; "
        f"the engine's activations and a draft's pools come on top)",
        f"  total       {format_bytes(report['total'])}",
        f"  free        {free}",
    ])


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
        weights_line(cfg),
        *kv_cache_lines(cfg),
    ]
    return "\n".join(lines)


STORED = {"fp4": "FP8 dense + FP4 experts, as published", "fp8": "FP8 dense + FP8 experts"}


def weights_line(cfg) -> str:
    """The weights' device bytes (MTP included) in bfloat16 and as a quantized checkpoint holds them
    (`ds4jax.io.stored_footprint`)."""
    from ds4jax.io.stored_footprint import weight_bytes
    from ds4jax.runtime.mesh_plan import format_bytes

    size = {q: format_bytes(weight_bytes(cfg, "bfloat16", q)) for q in (None, "fp4", "fp8")}
    return (f"weights       {size[None]} in bfloat16; {size['fp4']} {STORED['fp4']}; {size['fp8']} "
            f"{STORED['fp8']} (loaded with weights=\"checkpoint\")")


def kv_cache_lines(cfg) -> list[str]:
    """What the KV pools cost per token and per request slot in bf16 and with the FP8 cache (`--kv-dtype fp8`)."""
    from ds4jax.generation.engine import default_page_size
    from ds4jax.runtime import pool_spec
    from ds4jax.runtime.roles import Role

    page = default_page_size(cfg)
    spec = pool_spec.PoolSpec.for_role(cfg, role=Role.TARGET, max_slots=1, max_context=min(
        page, cfg.max_position_embeddings), page_size=page, dtype="bfloat16")
    fp8 = spec.replace(kv_dtype="float8_e4m3fn")  # FNUZ has the same size
    token = {s: pool_spec.bytes_per_token(s)["total"] for s in (spec, fp8)}
    swa = {s: pool_spec.bytes_per_slot(s)["swa"] for s in (spec, fp8)}
    if not token[spec]:
        return [f"kv cache      sliding rings only: {swa[spec]:,} B per request in bf16, {swa[fp8]:,} B with --kv-dtype fp8"]
    return [f"kv cache      {token[spec]:,.1f} B per token in bf16 (C4 + indexer + C128, all layers), "
            f"{token[fp8]:,.1f} B with --kv-dtype fp8: {pool_spec.fp8_capacity_gain(spec):.2f}x the tokens in the "
            f"same memory",
            f"              + per request: SWA ring {swa[spec]:,} B in bf16, {swa[fp8]:,} B fp8; compressor state "
            f"rings {pool_spec.bytes_per_slot(spec)['states']:,} B (float32 either way)"]
