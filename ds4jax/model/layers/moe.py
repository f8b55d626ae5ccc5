"""Mixture of experts (spec §3.9): sqrt-softplus router with selection bias or hash routing, clamped SwiGLU
routed experts through `jax.lax.ragged_dot`, plus the always-on shared expert.

Quantized experts (`ds4jax.model.quantized.QuantizedWeight`) work on every strategy: ``gather`` and ``tiles`` index
the stored bytes and dequantize only the experts they gathered; ``ragged`` dequantizes the stack (the CPU
reference). The pooled steps' kernel path reads FP4 in `pallas_kernels.grouped_matmul_fp4` and FP8 in
`pallas_kernels.grouped_matmul_fp8`.
"""

import os
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ds4jax.model.layer_of import resolve
from ds4jax.model.config import Config, MlpType
from ds4jax.model.layers.linear import linear, linear_f32
from ds4jax.model import official_numerics as numerics
from ds4jax.model.quantized import dense


class Routing(NamedTuple):
    experts: jax.Array  # [n, k] int32 selected expert ids
    weights: jax.Array  # [n, k] float32 routing weights (normalised, times routed_scaling_factor)


def route(x: jax.Array, token_ids: jax.Array, p: dict, cfg: Config, kind: MlpType) -> Routing:
    """x: [n, e] normalised tokens; token_ids: [n] (used by hash layers only)."""
    scores = jnp.sqrt(jax.nn.softplus(linear_f32(x, p["gate"])))  # [n, x]
    if kind is MlpType.HASH:
        experts = p["tid2eid"][token_ids]
    else:
        _, experts = jax.lax.top_k(scores + p["bias"].astype(jnp.float32), cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor
    return Routing(experts.astype(jnp.int32), weights)


def swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """Clamped SwiGLU: gate <= limit, up in [-limit, limit]."""
    return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


def shared_expert(x: jax.Array, p: dict, cfg: Config) -> jax.Array:
    """An FP8 SwiGLU MLP: under ``numerics="official"`` both its GEMMs' inputs are rounded (`round_act`)."""
    x = numerics.round_act(x, cfg)
    h = swiglu(linear(x, p["w1"]), linear(x, p["w3"]), cfg.swiglu_limit)
    return linear(numerics.round_act(h, cfg), p["w2"])


def moe_strategy(rows: int, num_experts: int) -> str:
    """How routed experts run for `rows` = tokens x experts-per-token selections (static, from shapes).

    * ``ragged``: `jax.lax.ragged_dot` grouped GEMMs (CPU/TPU; the reference).
    * ``gather``: each selection gathers its expert's weights (decode/verify: reads exactly the experts used).
    * ``tiles``: selections sorted by expert and padded to row tiles, one gathered weight block per tile
      (prefill on GPU, where XLA lowers ragged_dot to a dense product over every expert).
    Override with the environment variable ``DS4JAX_MOE``. These are the reference path; the pooled steps with
    Pallas kernels run routed experts through the grouped-matmul kernel instead (`ds4jax.runtime.kernels`)."""
    forced = os.environ.get("DS4JAX_MOE")
    if forced:
        if forced not in ("ragged", "gather", "tiles"):
            raise ValueError(f"DS4JAX_MOE={forced!r}: expected ragged, gather or tiles")
        return forced
    if jax.default_backend() in ("cpu", "tpu"):
        return "ragged"
    return "gather" if rows <= num_experts // 2 else "tiles"


def _ffn_rows(xs, w1, w3, w2, limit):
    """Expert FFN with weights per row (xs [n, e], w [n, e, f]) or per tile (xs [t, b, e], w [t, e, f])."""
    rows = "b" if xs.ndim == 3 else ""
    dot = lambda a, w, eq: jnp.einsum(eq, a, dense(w, a.dtype), preferred_element_type=jnp.float32)
    up = f"t{rows}e,tef->t{rows}f"
    h = swiglu(dot(xs, w1, up), dot(xs, w3, up), limit).astype(xs.dtype)
    return dot(h, w2, f"t{rows}f,tfe->t{rows}e")


TILE_PASS_BYTES = 1 << 30  # the gathered (dequantized) expert weights one pass of `_tile_passes` may hold


def _tile_passes(xs, tile_expert, p, cfg: Config):
    """`_ffn_rows` over tiles [t, b, e] whose experts are `tile_expert` [t], in passes of at most TILE_PASS_BYTES of
    gathered weights. Every tile gathers its expert's three matrices, so a prefill over Flash's 256 experts (at least
    one tile each) gathered ~13 GB at once in bfloat16, beside the model (the out-of-memory of the per-layer check,
    `scripts/layer_check.py`, at 16 layers on an H100); a small model stays one pass (the same program as before)."""
    tiles, tile, e = xs.shape
    f = p["w1"].shape[-1]
    per_tile = 3 * e * f * jnp.dtype(xs.dtype).itemsize
    group = max(1, TILE_PASS_BYTES // per_tile)
    one = lambda x, te: _ffn_rows(x, p["w1"][te], p["w3"][te], p["w2"][te], cfg.swiglu_limit)  # noqa: E731
    if group >= tiles:
        return one(xs, tile_expert)
    passes = -(-tiles // group)
    pad = passes * group - tiles  # padding tiles compute expert 0 on zero rows; their outputs are cut off
    xs = jnp.pad(xs, ((0, pad), (0, 0), (0, 0))).reshape(passes, group, tile, e)
    te = jnp.pad(tile_expert, (0, pad)).reshape(passes, group)
    y = jax.lax.map(lambda a: one(*a), (xs, te))
    return y.reshape(passes * group, tile, -1)[:tiles]


def _routed_tiles(x, flat_experts, flat_weights, k, p, cfg, tile: int):
    """Sorted selections padded so every `tile` rows share one expert; [n, e] f32."""
    n_sel, num_e = flat_experts.shape[0], cfg.num_routed_experts
    order = jnp.argsort(flat_experts, stable=True)
    sorted_e = flat_experts[order]
    sizes = jnp.bincount(flat_experts, length=num_e)
    padded = (sizes + tile - 1) // tile * tile
    starts = jnp.cumsum(sizes) - sizes
    pad_starts = jnp.cumsum(padded) - padded
    dest = pad_starts[sorted_e] + (jnp.arange(n_sel) - starts[sorted_e])  # unique padded row of each selection
    capacity = -(-(n_sel + num_e * (tile - 1)) // tile) * tile  # static bound on padded rows
    src = jnp.full((capacity,), -1, jnp.int32).at[dest].set(order.astype(jnp.int32))
    tiles = capacity // tile
    tile_expert = jnp.searchsorted(jnp.cumsum(padded), jnp.arange(tiles) * tile, side="right")
    tile_expert = jnp.minimum(tile_expert, num_e - 1)  # tiles past the last group hold only padding
    live = src >= 0
    xs = jnp.where(live[:, None], x[jnp.maximum(src, 0) // k], 0).reshape(tiles, tile, -1)
    y = _tile_passes(xs, tile_expert, p, cfg)
    w = jnp.where(live, flat_weights[jnp.maximum(src, 0)], 0.0)
    y = y.reshape(capacity, -1) * w[:, None]
    return jnp.zeros((x.shape[0], x.shape[-1]), jnp.float32).at[jnp.maximum(src, 0) // k].add(y)


def routed_experts(x: jax.Array, routing: Routing, p: dict, cfg: Config, strategy: str | None = None) -> jax.Array:
    """[n, e] -> [n, e] float32: sum over each token's selected experts of weight * expert(x)."""
    p = resolve(p)  # a scanned layer's experts arrive as `LayerOf`s: these strategies read per-layer arrays
    n, k = routing.experts.shape
    flat_experts = routing.experts.reshape(-1)  # [n*k]
    flat_weights = routing.weights.reshape(-1)
    strategy = strategy or moe_strategy(n * k, cfg.num_routed_experts)
    if strategy == "gather":
        xs = jnp.repeat(x, k, axis=0)
        y = _ffn_rows(xs, p["w1"][flat_experts], p["w3"][flat_experts], p["w2"][flat_experts], cfg.swiglu_limit)
        return jnp.sum((y * flat_weights[:, None]).reshape(n, k, -1), axis=1)
    if strategy == "tiles":
        tile = 64 if n * k <= 4096 else (128 if n * k <= 32768 else 256)  # bounds the gathered weight blocks
        return _routed_tiles(x, flat_experts, flat_weights, k, p, cfg, tile)
    order = jnp.argsort(flat_experts, stable=True)
    token_of = order // k
    group_sizes = jnp.bincount(flat_experts, length=cfg.num_routed_experts).astype(jnp.int32)
    xs = x[token_of]  # [n*k, e] grouped by expert
    dot = lambda a, w: jax.lax.ragged_dot(a, dense(w, a.dtype), group_sizes, preferred_element_type=jnp.float32)
    h = swiglu(dot(xs, p["w1"]), dot(xs, p["w3"]), cfg.swiglu_limit).astype(x.dtype)
    y = dot(h, p["w2"]) * flat_weights[order][:, None]  # [n*k, e] float32
    return jnp.zeros((n, x.shape[-1]), jnp.float32).at[token_of].add(y)


def moe(x: jax.Array, token_ids: jax.Array, p: dict, cfg: Config, kind: MlpType,
        routed=None) -> tuple[jax.Array, Routing]:
    """x: [..., e]; token_ids: [...]. Returns (output [..., e], routing over the flattened tokens).

    `routed(x, routing, p, cfg)` computes the routed experts (default `routed_experts`; the steps pass the
    kernel dispatcher's)."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    routing = route(flat, token_ids.reshape(-1), p, cfg, kind)
    routed = routed or routed_experts
    # the routed experts' input rounded as the official FP4 GEMMs' (not their hidden, W2's input: see
    # docs/official_numerics.md)
    out = routed(numerics.round_act(flat, cfg), routing, p["experts"], cfg)
    out = out + shared_expert(flat, p["shared"], cfg).astype(jnp.float32)
    return out.astype(x.dtype).reshape(shape), routing
