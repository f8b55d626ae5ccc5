"""Grouped matmul over row tiles with MXFP4 weights — portable Pallas kernel (Triton backend; interpret on CPU).

The routed-expert GEMM of an MoE layer reading the checkpoint's FP4 experts as they are: 0.53 bytes per weight
(packed E2M1 + one E8M0 byte per 32 inputs) instead of bf16's 2. Program (tile, column block, k split) streams
its expert's packed rows [block_j, block_n] and each row's scale byte (row j // 16, loaded per packed row so the
scale tile streams ahead like the packed one) and decodes them in registers (`fp4_times_scale`: float bits from
integer ops, one min, the scale multiply; no FP4 hardware assumed, which MI300 lacks) to x's dtype — exact, e2m1
times a power of two — then multiplies. Packed row j holds inputs 2j and 2j + 1, so x enters split into its even
and odd columns (the wrapper's strided slices of the activations): y = x_even @ W_low + x_odd @ W_high, one
block_j-deep dot per nibble and step. The kernel is ALU-bound (decoding), not bound by HBM: the decode is what
was made cheap. `BlockSizes(dots="group", decode="arith")` is the first version (two 16-deep dots per 32-input
scale group, value-arithmetic decode with int -> float conversions), kept to time against. Empty tiles (group -1)
read no weight; sorting, tiles and k splits are the bf16 grouped matmul's (`pallas_kernels.grouped_matmul`).

`BlockSizes(decode="f16")` decodes as the GEMV's default does (`decode_f16.py`: the step's bytes joined into
32-bit words in registers, two codes per mask and shift, through float16, x taking the factor 2^14): bitwise the
"bits" decode's output. sm90 loop count (`scripts/sass_count.py`, gate + up at Flash dims): 8.73 instructions a
weight per thread at 64-row tiles against 12.88, 8.38 at 16-row tiles against 12.82; shared memory 48 KB instead
of 64 KB at 64 rows, 56 KB instead of 40 KB at 16 rows (within MI300's 64 KB on gfx942 / gfx950 / sm90). The
default at 16-row tiles (1.11x / 1.31x faster for gate + up / down on an H200), and at prefill's 64-row tiles on
NVIDIA (3 stages); AMD's 64-row tiles keep "bits" (`BlockSizes.get_default` says why).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend
from pallas_kernels._mxfp4 import e2m1_to_float, e8m0_to_float, e8m0_to_float_max, fp4_times_scale, unpack_fp4
from pallas_kernels.grouped_matmul.tiles import write_tile
from pallas_kernels.grouped_matmul_fp4.blocks import DECODED_FRACTION, BlockSizes
from pallas_kernels.grouped_matmul_fp4.decode_f16 import check_block_n, fp4_as_f16
from pallas_kernels.grouped_matmul_fp4.launch import ROWS_PER_SCALE, launch
from pallas_kernels.grouped_matmul_fp4.validate import validate_grouped_matmul_fp4_static



def _scale_rows(s_ref, g, j0, block_j: int, n0, block_n: int):
    """The E8M0 scales of packed rows j0 .. j0 + block_j as float32 [block_j, block_n], each scale row repeated over
    its 16 packed rows: loaded so (row index j // 16 per element) rather than broadcast and reshaped in registers,
    which Triton lowers through shared memory after a synchronous load (not software-pipelined); this load is a plain
    [block_j, block_n] tile to it, streamed ahead like the packed one (the repeated rows are cache hits)."""
    rows = j0 // ROWS_PER_SCALE + lax.broadcasted_iota(jnp.int32, (block_j, block_n), 0) // ROWS_PER_SCALE
    cols = n0 + lax.broadcasted_iota(jnp.int32, (block_j, block_n), 1)
    return e8m0_to_float_max(s_ref[g, rows, cols])


def _decode(packed, scale, dtype, decode: str):
    """Packed [j, n] uint8 and float32 scales (broadcast to it) -> the even and odd inputs' weights in `dtype`."""
    if decode == "f16":  # values 2^-14 times the codes' (the caller scales x by 2^14)
        lo, hi = fp4_as_f16(packed)
        return (lo * scale).astype(dtype), (hi * scale).astype(dtype)
    even, odd = unpack_fp4(packed)
    if decode == "bits":
        return fp4_times_scale(even, scale).astype(dtype), fp4_times_scale(odd, scale).astype(dtype)
    return (e2m1_to_float(even) * scale).astype(dtype), (e2m1_to_float(odd) * scale).astype(dtype)


def _kernel(group_ref, xe_ref, xo_ref, *refs, n_w: int, block_j: int, j_per_split: int, dots: str, decode: str,
            precision):
    w_refs, o_refs = refs[: 2 * n_w], refs[2 * n_w:]
    block_n = o_refs[0].shape[1]
    g = group_ref[0]
    n0 = pl.program_id(1) * block_n
    j_base = pl.program_id(2) * j_per_split
    dtype = xe_ref.dtype
    dot = functools.partial(lax.dot, precision=precision, preferred_element_type=jnp.float32)
    def load_x(ref, j, n):  # times the inverse of what the decoded weights read (blocks.DECODED_FRACTION)
        x = ref[:, pl.ds(j, n)]
        return x if DECODED_FRACTION[decode] == 1.0 else x * jnp.asarray(1.0 / DECODED_FRACTION[decode], x.dtype)

    def body_tile(i, accs):  # the step's whole packed tile decoded at once: one block_j-deep dot per nibble
        j0 = pl.multiple_of(j_base + i * block_j, block_j)
        xe, xo = load_x(xe_ref, j0, block_j), load_x(xo_ref, j0, block_j)
        accs = list(accs)
        for w, (p_ref, s_ref) in enumerate(zip(w_refs[0::2], w_refs[1::2])):
            scale = _scale_rows(s_ref, g, j0, block_j, n0, block_n)
            lo, hi = _decode(p_ref[g, pl.ds(j0, block_j), pl.ds(n0, block_n)], scale, dtype, decode)
            accs[w] = accs[w] + dot(xe, lo) + dot(xo, hi)
        return tuple(accs)

    def body_group(i, accs):  # one 16-deep dot pair per scale group of 32 inputs (the first version)
        j0 = pl.multiple_of(j_base + i * block_j, block_j)
        accs = list(accs)
        for c in range(block_j // ROWS_PER_SCALE):
            j = j0 + c * ROWS_PER_SCALE
            xe, xo = load_x(xe_ref, j, ROWS_PER_SCALE), load_x(xo_ref, j, ROWS_PER_SCALE)
            for w, (p_ref, s_ref) in enumerate(zip(w_refs[0::2], w_refs[1::2])):
                scale = e8m0_to_float(s_ref[g, pl.ds(j // ROWS_PER_SCALE, 1), pl.ds(n0, block_n)])  # [1, n]
                lo, hi = _decode(p_ref[g, pl.ds(j, ROWS_PER_SCALE), pl.ds(n0, block_n)], scale, dtype, decode)
                accs[w] = accs[w] + dot(xe, lo) + dot(xo, hi)
        return tuple(accs)

    write_tile(g, o_refs, j_per_split // block_j, body_tile if dots == "tile" else body_group)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def grouped_matmul_fp4(x, ws, tile_group, *, block_sizes=None, interpret=False):
    """y[r] = x[r] @ W[tile_group[r // tile_m]] for each FP4 weight (see `reference`).

    Args:
      x: [rows, k] bf16/f32 (k % 32 == 0), rows = tiles * tile_m, sorted and padded by group.
      ws: tuple of (packed [groups, k/2, n] uint8, scales [groups, k/32, n] uint8 E8M0).
      tile_group: [tiles] i32 group of each tile, -1 = empty tile. block_sizes: `BlockSizes` or None.
    Returns:
      tuple of [rows, n] f32, one per weight; empty tiles give zeros.
    """
    ws = tuple(tuple(w) for w in ws)
    validate_grouped_matmul_fp4_static(x, ws, tile_group)
    bs = block_sizes or BlockSizes.get_default(x.dtype, x.shape[0] // tile_group.shape[0])
    bs.validate()
    if bs.decode not in ("bits", "arith", "f16"):
        raise ValueError(f"block_sizes.decode={bs.decode!r} is the GEMV's (grouped_gemv_fp4); the tile kernel "
                         "decodes with 'bits', 'arith' or 'f16'")
    if bs.decode == "f16":
        check_block_n(bs.block_n, ws[0][1].shape[-1])
    return launch(_kernel, x, ws, tile_group, bs, name="grouped_matmul_fp4", interpret=interpret, dots=bs.dots,
                  decode=bs.decode, precision=_backend.dot_precision(x.dtype))
