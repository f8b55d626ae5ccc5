"""Grouped matmul over row tiles — the specification (pure jnp).

Rows are sorted by group and padded so that each tile of `tile_m` consecutive rows belongs to one group:
  y[r] = x[r] @ w[tile_group[r // tile_m]]   (f32 accumulation; a tile with group -1 gives zeros).
Several weights of one shape may be given (an MoE layer's gate and up projections): one output each.
Letters: r rows (tiles * tile_m), k input dim, n output dim, g groups (experts).
"""

from __future__ import annotations

import jax.numpy as jnp


def grouped_matmul_reference(x, ws, tile_group, *, block_sizes=None, interpret=False):
    """x [r, k], ws: tuple of [g, k, n], tile_group [tiles] i32 (-1 = empty) -> tuple of [r, n] f32."""
    del block_sizes, interpret
    tiles = tile_group.shape[0]
    tile_m = x.shape[0] // tiles
    live = tile_group >= 0
    xt = x.reshape(tiles, tile_m, -1)
    out = []
    for w in ws:
        wt = w[jnp.maximum(tile_group, 0)]  # [tiles, k, n]; empty tiles' weights are masked below
        y = jnp.einsum("tmk,tkn->tmn", xt.astype(jnp.float32), wt.astype(jnp.float32), precision="highest")
        out.append(jnp.where(live[:, None, None], y, 0.0).reshape(x.shape[0], -1))
    return tuple(out)


def grouped_matmul_dequantized(x, ws, tile_group, dequantize):
    """`grouped_matmul_reference` over quantized experts: each weight of `ws` is (values [g, ...], scales [g, ...]),
    and every tile multiplies by `dequantize(values[e], scales[e])` of its own expert e (a gather first: unused
    experts' bytes are never read). The spec of the grouped kernels that read FP4 / FP8 weights as stored."""
    groups = jnp.maximum(tile_group, 0)
    per_tile = jnp.where(tile_group >= 0, jnp.arange(tile_group.shape[0], dtype=jnp.int32), -1)
    return tuple(grouped_matmul_reference(x, (dequantize(values[groups], scales[groups]),), per_tile)[0]
                 for values, scales in ws)
