"""The launch both FP4 grouped kernels share (the tile kernel and its one-row GEMV form): block sizes fitted to the
weights, k splits, x split into the packed rows' even and odd inputs, grid (tile, column block, k split), one
partial output per k split summed after the call."""

from __future__ import annotations

import functools

from jax.experimental import pallas as pl

from pallas_kernels import _backend
from pallas_kernels.grouped_matmul.blocks import choose_k_splits
from pallas_kernels.grouped_matmul.tiles import split_outputs, sum_splits

ROWS_PER_SCALE = 16  # packed rows (32 inputs) per E8M0 scale


def launch(kernel, x, ws, tile_group, bs, *, name: str, interpret: bool, **static):
    """`kernel(group_ref, xe_ref, xo_ref, *weight refs, *out refs, n_w, block_j, j_per_split, **static)` over the
    grid (tile, column block, k split); tiles of x.shape[0] // len(tile_group) rows. Returns [rows, n] f32 per
    weight."""
    rows = x.shape[0]
    kk, n = ws[0][0].shape[1:]
    tiles = tile_group.shape[0]
    tile_m = rows // tiles
    block_n = min(bs.block_n, n)
    block_j = max(ROWS_PER_SCALE, min(bs.block_j, kk) // ROWS_PER_SCALE * ROWS_PER_SCALE)
    if n % block_n or kk % block_j:
        raise ValueError(f"n={n} and k/2={kk} must be multiples of block_n={block_n} and block_j={block_j}")
    n_blocks, j_blocks = n // block_n, kk // block_j
    k_splits = choose_k_splits(bs.k_splits, tiles=tiles, n_blocks=n_blocks, k_blocks=j_blocks)
    x_even, x_odd = x[:, 0::2], x[:, 1::2]  # inputs 2j and 2j + 1: packed row j's low and high nibbles
    whole = lambda a: pl.BlockSpec(a.shape, lambda t, j, s: (0,) * a.ndim)  # noqa: E731
    x_spec = pl.BlockSpec((tile_m, kk), lambda t, j, s: (t, 0))
    flat_ws = [a for pair in ws for a in pair]
    out_specs, out_shape = split_outputs(len(ws), k_splits=k_splits, rows=rows, tile_m=tile_m, n=n, block_n=block_n)
    out = pl.pallas_call(
        functools.partial(kernel, n_w=len(ws), block_j=block_j, j_per_split=kk // k_splits, **static),
        grid=(tiles, n_blocks, k_splits),
        in_specs=[pl.BlockSpec((1,), lambda t, j, s: (t,)), x_spec, x_spec] + [whole(a) for a in flat_ws],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_backend.compiler_params(num_warps=bs.num_warps, num_stages=bs.num_stages,
                                                 interpret=interpret),
        interpret=interpret,
        name=name,
    )(tile_group, x_even, x_odd, *flat_ws)
    return sum_splits(out)
