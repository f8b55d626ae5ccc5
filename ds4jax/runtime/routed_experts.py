"""Routed experts through the grouped-matmul kernel: selections sorted by expert into row tiles.

The n·k (token, expert) selections are sorted by expert and padded so every tile of `tile_m` rows has one expert;
`pallas_kernels.grouped_matmul` then reads each used expert's weights once per tile — at decode exactly the
selected experts, nothing else — for the gate and up projections together, then the down projection. The
result, weighted, is scattered back to the tokens (padding rows are dropped). Quantized experts (a checkpoint
loaded with ``weights="checkpoint"``) are read as stored: FP4 through `pallas_kernels.grouped_matmul_fp4` (packed
bytes), FP8 (base checkpoints) through `pallas_kernels.grouped_matmul_fp8` (E4M3 + block scales).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ds4jax.model.config import Config
from ds4jax.model.layers.moe import Routing, swiglu
from ds4jax.model.quantized import Format, dense, is_quantized

DECODE_TILE = 16  # Triton's smallest matmul extent: a decode selection fills one row of a 16-row tile
PREFILL_TILE = 64
PREFILL_ABOVE = 256  # selections above which tiles of 64 rows pay off (several tokens per expert)


def tile_rows(selections: int) -> int:
    return PREFILL_TILE if selections > PREFILL_ABOVE else DECODE_TILE


def sort_into_tiles(experts: jax.Array, num_experts: int, tile_m: int) -> tuple[jax.Array, jax.Array]:
    """experts [S] -> (src [tiles * tile_m]: selection of each row, -1 = padding; tile_group [tiles], -1 = empty).

    tiles = min(S, ceil(S / tile_m) + min(E, S)) bounds sum_e ceil(size_e / tile_m) statically."""
    s = experts.shape[0]
    tiles = min(s, -(-s // tile_m) + min(num_experts, s))
    order = jnp.argsort(experts, stable=True).astype(jnp.int32)
    sorted_e = experts[order]
    sizes = jnp.bincount(experts, length=num_experts)
    padded = (sizes + tile_m - 1) // tile_m * tile_m
    ends = jnp.cumsum(padded)
    dest = (ends - padded)[sorted_e] + jnp.arange(s) - (jnp.cumsum(sizes) - sizes)[sorted_e]
    src = jnp.full((tiles * tile_m,), -1, jnp.int32).at[dest].set(order, mode="drop")
    first_row = jnp.arange(tiles, dtype=jnp.int32) * tile_m
    # compare_all: one fused comparison (the default binary search is a device while loop: many tiny kernels)
    group = jnp.searchsorted(ends, first_row, side="right", method="compare_all").astype(jnp.int32)
    return src, jnp.where(first_row < ends[-1], group, -1)


def _grouped(x: jax.Array, ws: tuple, tile_group: jax.Array, interpret: bool) -> tuple[jax.Array, ...]:
    """The grouped matmul for the weights' storage: FP4 experts through the kernel that reads the packed bytes,
    FP8 experts (base checkpoints) through the one that reads E4M3 + block scales; arrays as they are (a mix of
    formats, which no checkpoint has, would be dequantized whole first)."""
    import pallas_kernels  # here, not at the top: see __getattr__ below
    if all(is_quantized(w) and w.format is Format.FP4 for w in ws):
        return pallas_kernels.grouped_matmul_fp4(x, tuple((w.values, w.scales) for w in ws), tile_group,
                                                 interpret=interpret)
    if all(is_quantized(w) and w.format is Format.FP8 and w.block == ws[0].block for w in ws):
        return pallas_kernels.grouped_matmul_fp8(x, tuple((w.values, w.scales) for w in ws), tile_group,
                                                 block=ws[0].block, interpret=interpret)
    return pallas_kernels.grouped_matmul(x, tuple(dense(w, x.dtype) for w in ws), tile_group, interpret=interpret)


def routed_experts_grouped(x: jax.Array, routing: Routing, p: dict, cfg: Config, *, interpret: bool) -> jax.Array:
    """[n, e] -> [n, e] float32, the same sum as `moe.routed_experts`."""
    n, k = routing.experts.shape
    tile_m = tile_rows(n * k)
    src, tile_group = sort_into_tiles(routing.experts.reshape(-1), cfg.num_routed_experts, tile_m)
    live = src >= 0
    token = jnp.where(live, src // k, n)  # padding rows: out of range, dropped by the scatter below
    xs = jnp.where(live[:, None], x[jnp.minimum(token, n - 1)], 0).astype(x.dtype)
    gate, up = _grouped(xs, (p["w1"], p["w3"]), tile_group, interpret)
    h = swiglu(gate, up, cfg.swiglu_limit).astype(x.dtype)
    (y,) = _grouped(h, (p["w2"],), tile_group, interpret)
    weight = jnp.where(live, routing.weights.reshape(-1)[jnp.maximum(src, 0)], 0.0)
    return jnp.zeros((n, x.shape[-1]), jnp.float32).at[token].add(y * weight[:, None], mode="drop")


def __getattr__(name: str):
    """``<this module>.pallas_kernels``, for callers and tests that reach the kernels through it: the package is
    imported where a program is traced (a cached ``ds4jax generate`` traces none: tests/test_startup_imports.py)."""
    if name == "pallas_kernels":
        import pallas_kernels

        return pallas_kernels
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
