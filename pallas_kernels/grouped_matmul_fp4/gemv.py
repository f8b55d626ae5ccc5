"""One row per expert selection with MXFP4 weights — the decode form of the FP4 grouped matmul (Triton backend;
interpret on CPU).

At decode each (token, expert) selection multiplies one row by its expert's weight. The tile kernel
(`kernel.grouped_matmul_fp4`) pads every selection to a 16-row tile for Triton's dot and decodes the packed tile
into the dot's operand layout, which made it ALU-bound far from the memory floor (flash_slice(4) decode, H200:
463 us per step for gate + up at batch 1, where the packed bytes need ~20 us). Here there is no dot: program
(selection, column block, k split) takes its expert's packed rows one scale group (16 rows, 32 inputs) a step,
decodes them to float32 in registers (E2M1 values from integer ops, exact; no FP4 hardware assumed, which MI300
lacks), multiplies them by the selection's even and odd inputs broadcast along the columns and by the group's one
scale row, and accumulates in the tile's own layout; the column sums are taken once at the end. No sort into tiles
either: the selections' experts index the weights directly (a selection of group -1 writes zeros and reads no
weight). Two selections of one expert read its bytes twice (at decode batch 8, ~10 % of 48 selections).
On the H100 the first integer decode (`decode="bits"`) was ~20 % faster than the tile kernel at batch 1 and 8 and
still bound by its own integer work (22-33 % of the bandwidth over every tile tried), not by the bytes;
`decode="quarter"` takes one integer op per code fewer (`_quarter_values`). `decode="fp8"`
moves each code's bits into an OCP E4M3 byte instead (`_mxfp4.fp4_as_e4m3`: two masks and shifts per code) and lets
the device's FP8 conversion make the float (one instruction per pair on sm90); the E4M3 byte reads 2^-6 times the
code's value, which the kernel gives back exactly by taking the inputs times 2^6 (powers of two: every product is
bitwise the integer decodes', unless an input exceeds 2^121): 11-14 % faster than "quarter" on the H100, and the
sm89+ default until `decode="f16"` (`decode_f16.py`: two codes per mask and shift on 32-bit words, through float16),
1.34-1.42x faster again, became the default on every target (`GEMV_DEFAULT`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._mxfp4 import (E2M1_BIAS_BITS, e8m0_to_float_max, fp4_as_e4m3, fp4_times_scale,
                                   unpack_fp4)
from pallas_kernels.grouped_matmul.tiles import write_tile
from pallas_kernels.grouped_matmul_fp4.blocks import DECODED_FRACTION, BlockSizes
from pallas_kernels.grouped_matmul_fp4.decode_f16 import check_block_n, fp4_as_f16
from pallas_kernels.grouped_matmul_fp4.kernel import _scale_rows
from pallas_kernels.grouped_matmul_fp4.launch import ROWS_PER_SCALE, launch
from pallas_kernels.grouped_matmul_fp4.validate import validate_grouped_gemv_fp4_static


# H100, Flash dims, batch 1 and 8 (`bench_kernels.py --ops fp4_gemv_gate_up,fp4_gemv_down --sweep`): a scale group a
# step with 128 columns and 16 k splits took 63.5 / 406 us for gate + up and 34.1 / 218 us for down, against 80.3 /
# 500 and 39.0 / 228 us for 64 packed rows a step (dots="tile", block_n 64, the heuristic's 2-3 splits); every
# variant stayed at 22-33 % of the bandwidth: the decode's integer work, not the bytes, bounds the kernel.
# The default decode since round 3, session 23: "f16" (`decode_f16.py`: two codes per mask and shift, through
# float16). H100, Flash dims, device time (docs/benchmarks/fp4_words_h100/kernels.md, one run at 2771c73), batch 1 /
# 8: gate + up 39.9 / 244 us against 55.0 / 345 for "fp8" (the sm89+ default before) and 62.0 / 395 for "quarter";
# down 22.6 / 134 against 30.3 / 190 and 33.2 / 213 (44-54 % of the measured bandwidth, from 29-39 %). It needs no
# FP8 or FP4 instruction (integer ops and float16 -> float32 conversions), so every target takes it; on AMD it is
# compiled and counted, not timed (no AMD GPU here). "fp8" (the device's FP8 conversion, sm89+ and gfx950) and
# "quarter" stay selectable.
GEMV_DEFAULT = BlockSizes(block_n=128, k_splits=16, dots="group", decode="f16")
AMD_FP8_ARCHS = ("gfx950",)  # AMD targets whose Triton converts OCP E4M3


def converts_fp8(arch: str | None) -> bool:
    """Whether `arch` converts OCP E4M3 in hardware (NVIDIA sm89+, `AMD_FP8_ARCHS`): where decode="fp8" can run."""
    if arch is not None and arch.startswith("sm") and arch[2:].isdigit():
        return int(arch[2:]) >= 89
    return arch in AMD_FP8_ARCHS


def gemv_block_sizes(arch: str | None) -> BlockSizes:
    """The GEMV's tiles on `arch` (None: generic, e.g. the interpreter): `GEMV_DEFAULT` on every architecture (the
    word-wise float16 decode; the dispatcher asks per architecture so that one can differ again)."""
    del arch
    return GEMV_DEFAULT


QUARTER_BIAS_BITS = 124 << 23  # float32 exponent field 124 (low two bits clear): OR-ed, not added, to the code bits


def _quarter_values(codes):
    """int32 E2M1 codes -> float32 values / 4 (no scale). The magnitude bits (e1 e0 m) at float bits 24..22 under
    exponent field 124 read 2^(e - 3) (1 + m/2), a quarter of the E2M1 value for e > 0; as the field's low bits are
    clear, one OR places them (no add, no carry: one integer op per code fewer than `fp4_times_scale`'s bias). The
    two codes with e = 0 read 0.125 and 0.1875 for 0 and 0.125: 2v - 0.25, which min(v, 2v - 0.25) picks (exact).
    The sign goes on last, by OR. Gate + up loop at Flash dims: sm90 SASS 594 instructions instead of 624 (248 on
    the integer pipe instead of 286), gfx950 360 vector ALU instructions instead of 389."""
    v = lax.bitcast_convert_type(((codes & 7) << 22) | QUARTER_BIAS_BITS, jnp.float32)
    bits = lax.bitcast_convert_type(jnp.minimum(v, v * 2.0 - 0.25), jnp.int32) | ((codes & 8) << 28)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _fp4_values(codes):
    """int32 E2M1 codes -> float32 values (no scale): `fp4_times_scale` with the scale multiply left out (the GEMV's
    first integer decode, `decode="bits"`, kept to time against)."""
    v = lax.bitcast_convert_type(((codes & 7) << 22) + E2M1_BIAS_BITS, jnp.float32)
    bits = lax.bitcast_convert_type(jnp.minimum(v, v * 2.0 - 1.0), jnp.int32) | ((codes & 8) << 28)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _kernel(group_ref, xe_ref, xo_ref, *refs, n_w: int, block_j: int, j_per_split: int, dots: str, decode: str):
    w_refs, o_refs = refs[: 2 * n_w], refs[2 * n_w:]
    block_n = o_refs[0].shape[1]
    g = group_ref[0]
    n0 = pl.program_id(1) * block_n
    j_base = pl.program_id(2) * j_per_split

    def body_group(i, accs):  # dots="group": one scale group (16 packed rows) a step, one [1, n] scale row
        j0 = pl.multiple_of(j_base + i * ROWS_PER_SCALE, ROWS_PER_SCALE)
        xe = xe_ref[0, pl.ds(j0, ROWS_PER_SCALE)].astype(jnp.float32)[:, None]
        xo = xo_ref[0, pl.ds(j0, ROWS_PER_SCALE)].astype(jnp.float32)[:, None]
        if DECODED_FRACTION[decode] != 1.0:
            xe, xo = xe * (1.0 / DECODED_FRACTION[decode]), xo * (1.0 / DECODED_FRACTION[decode])
        out = []
        for acc, p_ref, s_ref in zip(accs, w_refs[0::2], w_refs[1::2]):
            scale = e8m0_to_float_max(s_ref[g, pl.ds(j0 // ROWS_PER_SCALE, 1), pl.ds(n0, block_n)])  # [1, n]
            packed = p_ref[g, pl.ds(j0, ROWS_PER_SCALE), pl.ds(n0, block_n)]
            if decode == "f16":
                lo, hi = fp4_as_f16(packed)
            elif decode == "fp8":
                lo, hi = (v.astype(jnp.float32) for v in fp4_as_e4m3(packed))
            else:
                even, odd = unpack_fp4(packed)
                values = _quarter_values if decode == "quarter" else _fp4_values
                lo, hi = values(even), values(odd)
            out.append(acc + (xe * lo + xo * hi) * scale)
        return tuple(out)

    def body(i, accs):  # accumulators [block_j, block_n]: one FMA per weight, no cross-lane work in the loop
        j0 = pl.multiple_of(j_base + i * block_j, block_j)
        xe = xe_ref[0, pl.ds(j0, block_j)].astype(jnp.float32)[:, None]
        xo = xo_ref[0, pl.ds(j0, block_j)].astype(jnp.float32)[:, None]
        out = []
        for acc, p_ref, s_ref in zip(accs, w_refs[0::2], w_refs[1::2]):
            scale = _scale_rows(s_ref, g, j0, block_j, n0, block_n)
            even, odd = unpack_fp4(p_ref[g, pl.ds(j0, block_j), pl.ds(n0, block_n)])
            out.append(acc + xe * fp4_times_scale(even, scale) + xo * fp4_times_scale(odd, scale))
        return tuple(out)

    def store(o_ref, acc):  # the column sums: [1, block_n] (an empty selection's zeros sum to zeros too)
        o_ref[...] = jnp.sum(acc, axis=0, keepdims=True)

    if dots == "group":
        write_tile(g, o_refs, j_per_split // ROWS_PER_SCALE, body_group, shape=(ROWS_PER_SCALE, block_n), store=store)
    else:
        write_tile(g, o_refs, j_per_split // block_j, body, shape=(block_j, block_n), store=store)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def grouped_gemv_fp4(x, ws, group, *, block_sizes=None, interpret=False):
    """y[s] = x[s] @ W[group[s]] for each FP4 weight (see `grouped_gemv_fp4_reference`).

    Args:
      x: [selections, k] bf16/f32 (k % 32 == 0): one row per selection.
      ws: tuple of (packed [groups, k/2, n] uint8, scales [groups, k/32, n] uint8 E8M0).
      group: [selections] i32 expert of each row, -1 = none (zeros, no weight read).
      block_sizes: `BlockSizes` (None: `GEMV_DEFAULT`; block_n, block_j, k_splits, num_warps, num_stages; dots
        "tile": block_j packed
        rows a step, each weight decoded times its own scale (the scale tile loaded per packed row); "group": one
        scale group (16 packed rows) a step, its scale row loaded once and applied to the step's products;
        decode (dots="group"): "quarter" (an integer decode, `_quarter_values`), "fp8" (through the FP8
        conversion), "f16" (the default: 32-bit words, two codes per mask and shift, through float16:
        `decode_f16.py`),
        "bits" / "arith" (the first integer decode, `_fp4_values`)).
    Returns:
      tuple of [selections, n] f32, one per weight.
    """
    ws = tuple(tuple(w) for w in ws)
    validate_grouped_gemv_fp4_static(x, ws, group)
    bs = block_sizes or GEMV_DEFAULT
    bs.validate()
    if bs.decode in ("fp8", "quarter", "f16") and bs.dots != "group":
        raise ValueError(f"block_sizes.decode={bs.decode!r} needs dots='group' (one scale group a step)")
    if bs.decode == "f16":
        check_block_n(bs.block_n, ws[0][1].shape[-1])
    return launch(_kernel, x, ws, group, bs, name="grouped_gemv_fp4", interpret=interpret, dots=bs.dots,
                  decode=bs.decode)


def grouped_gemv_fp4_reference(x, ws, group, *, block_sizes=None, interpret=False):
    """The specification: each row times its own expert's dequantized weight (only those experts are read)."""
    from pallas_kernels.grouped_matmul_fp4.reference import grouped_matmul_fp4_reference

    del block_sizes, interpret
    return grouped_matmul_fp4_reference(x, ws, group)  # a tile of one row per selection is the same sum
