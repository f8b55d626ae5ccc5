"""Grouped matmul over row tiles — portable Pallas kernel (Triton backend; interpret mode on CPU).

The routed-expert GEMM of an MoE layer: rows (token-expert selections) are sorted by expert and padded so that
each tile of `tile_m` rows has one expert; program (tile, column block, k split) streams its expert's weight
tiles [block_k, block_n] straight from the [experts, k, n] weight array and multiplies the tile's rows by them.
Decode (a few selections): every selected expert's weights are read once, nothing else (an empty tile, group -1,
reads no weight); k splits keep enough programs streaming. Prefill: tiles of 64 rows make it a grouped GEMM.
Several weights of one shape (gate and up projections) share the x loads and the launch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend
from pallas_kernels.grouped_matmul.blocks import BlockSizes, choose_k_splits
from pallas_kernels.grouped_matmul.tiles import split_outputs, sum_splits, write_tile
from pallas_kernels.grouped_matmul.validate import validate_grouped_matmul_static


def _kernel(group_ref, x_ref, *refs, n_w: int, block_k: int, k_per_split: int, precision):
    w_refs, o_refs = refs[:n_w], refs[n_w:]
    block_n = o_refs[0].shape[1]
    g = group_ref[0]
    n0 = pl.program_id(1) * block_n
    k_base = pl.program_id(2) * k_per_split

    def body(i, accs):
        k0 = pl.multiple_of(k_base + i * block_k, block_k)
        xk = x_ref[:, pl.ds(k0, block_k)]
        return tuple(
            acc + lax.dot(xk, w[g, pl.ds(k0, block_k), pl.ds(n0, block_n)], precision=precision,
                          preferred_element_type=jnp.float32)
            for acc, w in zip(accs, w_refs))

    write_tile(g, o_refs, k_per_split // block_k, body)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def grouped_matmul(x, ws, tile_group, *, block_sizes=None, interpret=False):
    """y[r] = x[r] @ w[tile_group[r // tile_m]] for each w in `ws` (see `reference`).

    Args:
      x: [rows, k] bf16/f32, rows = tiles * tile_m, sorted and padded by group.
      ws: tuple of [groups, k, n] (x's dtype). tile_group: [tiles] i32 group of each tile, -1 = empty tile.
      block_sizes: `BlockSizes` (static) or None. interpret: Pallas interpreter.
    Returns:
      tuple of [rows, n] f32, one per weight; empty tiles give zeros.
    """
    ws = tuple(ws)
    validate_grouped_matmul_static(x, ws, tile_group)
    rows, k = x.shape
    n = ws[0].shape[2]
    tiles = tile_group.shape[0]
    tile_m = rows // tiles
    bs = block_sizes or BlockSizes.get_default(x.dtype, tile_m)
    block_n, block_k = min(bs.block_n, n), min(bs.block_k, k)
    if n % block_n or k % block_k:
        raise ValueError(f"n={n} and k={k} must be multiples of block_n={block_n} and block_k={block_k}")
    n_blocks, k_blocks = n // block_n, k // block_k
    k_splits = choose_k_splits(bs.k_splits, tiles=tiles, n_blocks=n_blocks, k_blocks=k_blocks)
    whole = lambda a: pl.BlockSpec(a.shape, lambda t, j, s: (0,) * a.ndim)
    out_specs, out_shape = split_outputs(len(ws), k_splits=k_splits, rows=rows, tile_m=tile_m, n=n, block_n=block_n)
    out = pl.pallas_call(
        functools.partial(_kernel, n_w=len(ws), block_k=block_k, k_per_split=k // k_splits,
                          precision=_backend.dot_precision(x.dtype)),
        grid=(tiles, n_blocks, k_splits),
        in_specs=[pl.BlockSpec((1,), lambda t, j, s: (t,)), pl.BlockSpec((tile_m, k), lambda t, j, s: (t, 0))]
        + [whole(w) for w in ws],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_backend.compiler_params(num_warps=bs.num_warps, num_stages=bs.num_stages,
                                                 interpret=interpret),
        interpret=interpret,
        name="grouped_matmul",
    )(tile_group, x, *ws)
    return sum_splits(out)
