"""Grouped matmul over row tiles with block-scaled FP8 weights — portable Pallas kernel (Triton backend;
interpret mode on CPU).

The routed-expert GEMM of an MoE layer reading a base checkpoint's FP8 experts as stored: 1 byte per weight (+ one
f32 per 128 x 128 block) instead of bf16's 2, and no dequantized copy of the expert stack. Program (tile, column
block, k split) streams its expert's [block_k, block_n] E4M3 tiles from the [experts, k, n] values, each inside one
scale block (one scalar scale per weight and step), decodes them in registers to x's dtype — exactly the
reference's dequantized weight; FNUZ (MI300) as bytes with integer ops (`_fp8.to_compute`) — and accumulates the
dot in f32. Sorting, tiles, empty tiles (group -1: no weight or scale read) and k splits are the bf16 grouped
matmul's (`pallas_kernels.grouped_matmul`); in / out dims need not be multiples of the tiles: weight and x tiles
crossing the k or n edge use masked loads, the output's n edge a masked store (as in `fp8_matmul`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend
from pallas_kernels._fp8 import kernel_operand, to_compute
from pallas_kernels._util import cdiv, edge_bound
from pallas_kernels.fp8_matmul.blocks import fit_block
from pallas_kernels.grouped_matmul.blocks import choose_k_splits
from pallas_kernels.grouped_matmul.tiles import sum_splits, write_tile
from pallas_kernels.grouped_matmul_fp8.blocks import BlockSizes
from pallas_kernels.grouped_matmul_fp8.validate import validate_grouped_matmul_fp8_static


def _kernel(group_ref, x_ref, *refs, n_w: int, block, block_k: int, block_n: int, steps: int, precision):
    w_refs, o_refs = refs[: 2 * n_w], refs[2 * n_w:]
    tile_m, k = x_ref.shape
    n = o_refs[0].shape[1]
    g = group_ref[0]
    n0 = pl.program_id(1) * block_n
    k_base = pl.program_id(2) * (steps * block_k)
    k_edge, n_edge = edge_bound(k, block_k), edge_bound(n, block_n)
    dtype = x_ref.dtype

    def body(i, accs):
        k0 = pl.multiple_of(k_base + i * block_k, block_k)
        xk = _backend.load_tile(x_ref, (0, k0), (tile_m, block_k), (None, k_edge))
        out = []
        for acc, v_ref, s_ref in zip(accs, w_refs[0::2], w_refs[1::2]):
            v = _backend.load_tile(v_ref, (k0, n0), (block_k, block_n), (k_edge, n_edge), lead=(g,))
            scale = s_ref[g, k0 // block[0], n0 // block[1]]
            w = (to_compute(v, jnp.float32) * scale).astype(dtype)  # = the reference's dequantized tile, exactly
            out.append(acc + lax.dot(xk, w, precision=precision, preferred_element_type=jnp.float32))
        return tuple(out)

    store = lambda o, val: _backend.store_tile(o, (0, n0), val, (None, n_edge))
    write_tile(g, o_refs, steps, body, shape=(tile_m, block_n), store=store)


@functools.partial(jax.jit, static_argnames=("block", "block_sizes", "interpret"))
def grouped_matmul_fp8(x, ws, tile_group, *, block=(128, 128), block_sizes=None, interpret=False):
    """y[r] = x[r] @ W[tile_group[r // tile_m]] for each FP8 weight (see `reference`).

    Args:
      x: [rows, k] bf16/f32, rows = tiles * tile_m, sorted and padded by group.
      ws: tuple of (values [groups, k, n] float8_e4m3fn / float8_e4m3fnuz (all one dtype; it decides the decode),
        scales [groups, ceil(k / bi), ceil(n / bo)] f32) for block = (bi, bo) (static).
      tile_group: [tiles] i32 group of each tile, -1 = empty tile. block_sizes: `BlockSizes` (static) or None
        (`BlockSizes.get_default(x.dtype, tile_m)`). interpret: Pallas interpreter.
    Returns:
      tuple of [rows, n] f32, one per weight; empty tiles give zeros.
    """
    ws = tuple(tuple(w) for w in ws)
    block = tuple(block)
    validate_grouped_matmul_fp8_static(x, ws, tile_group, block)
    rows, k = x.shape
    n = ws[0][0].shape[2]
    tiles = tile_group.shape[0]
    tile_m = rows // tiles
    bs = block_sizes or BlockSizes.get_default(x.dtype, tile_m)
    min_dot = _backend.min_dot_dim(interpret)
    block_k, block_n = fit_block(bs.block_k, block[0], k, min_dot), fit_block(bs.block_n, block[1], n, min_dot)
    n_blocks, k_blocks = cdiv(n, block_n), cdiv(k, block_k)
    k_splits = choose_k_splits(bs.k_splits, tiles=tiles, n_blocks=n_blocks, k_blocks=k_blocks)
    whole = lambda a: pl.BlockSpec(a.shape, lambda t, j, s: (0,) * a.ndim)
    flat_ws = [a for values, scales in ws for a in (kernel_operand(values), scales)]  # FNUZ as its bytes
    # each k split its own partial; a program writes its row tile's [tile_m, block_n] columns (masked at n's edge)
    out_spec = pl.BlockSpec((None, tile_m, n), lambda t, j, s: (s, t, 0))
    out = pl.pallas_call(
        functools.partial(_kernel, n_w=len(ws), block=block, block_k=block_k, block_n=block_n,
                          steps=k_blocks // k_splits, precision=_backend.dot_precision(x.dtype)),
        grid=(tiles, n_blocks, k_splits),
        in_specs=[pl.BlockSpec((1,), lambda t, j, s: (t,)), pl.BlockSpec((tile_m, k), lambda t, j, s: (t, 0))]
        + [whole(a) for a in flat_ws],
        out_specs=[out_spec for _ in ws],
        out_shape=[jax.ShapeDtypeStruct((k_splits, rows, n), jnp.float32) for _ in ws],
        compiler_params=_backend.compiler_params(num_warps=bs.num_warps, num_stages=bs.num_stages,
                                                 interpret=interpret),
        interpret=interpret,
        name="grouped_matmul_fp8",
    )(tile_group, x, *flat_ws)
    return sum_splits(out)
