"""The FP4 GEMV decoding 32-bit words of packed codes through float16 (`decode="f16"`).

The byte-wise decodes (`gemv.py`: "quarter", "fp8") spend ~9.3 instructions per weight in the loop on sm90, most
of them integer work on one code at a time (each byte in its own register, masked and shifted twice). Here a
step's packed bytes are assembled into uint32 words in registers (four columns a word: the shifts and ors of
consecutive bytes a thread already holds, which the compiler turns into plain word moves; weights stored as words
are read as they are) and every mask and shift works on two codes at once: the magnitude bits (e1 e0 m) of bytes
b and b + 2 of a word (16 bits apart) go to bits 9..11 of their 16-bit halves and the sign bits to bit 15, which
makes each half a float16 reading exactly 2^-14 times the code's E2M1 value (exponent field e; for e = 0 the
float16 subnormal m/2 * 2^-14: no special case, unlike the float32 placement of "quarter"). The conversion
float16 -> float32 is one instruction per value on every GPU (no FP8 or FP4 hardware needed: MI300 can use it
too), the decoded values are joined back into column order, and the inputs take the inverse factor 2^14 (a power
of two: every product is bitwise the other decodes').

sm90 loop, gate + up at Flash dims (`scripts/sass_count.py`): ~6.2 instructions per weight per thread at 4 warps,
~6.0 at 2, against 9.28 for "quarter" and 9.77 for "fp8". H100, device time (docs/benchmarks/fp4_words_h100/):
1.34-1.42x faster than "fp8" at batch 1 and 8; the GEMV's default on every target.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._mxfp4 import e8m0_to_float_max
from pallas_kernels.grouped_matmul.tiles import write_tile
from pallas_kernels.grouped_matmul_fp4.launch import ROWS_PER_SCALE, launch

WORD = 4  # packed bytes (columns) per uint32 word
F16_PER_E2M1 = 2.0**-14  # what an E2M1 code reads as once its bits sit in a float16 (`_f16_pair`)


def as_words(a):
    """uint8 [..., n] -> uint32 [..., n / 4], the same bytes: byte b of word w is column 4w + b (little-endian, as
    every GPU JAX runs on). For weights to be stored as words: in XLA it is not a free view (a bitcast-convert to
    a wider type is expanded into shifts and ors, a copy of the whole array), so never call it per step; the
    kernel reads byte-stored weights as they are."""
    return lax.bitcast_convert_type(a.reshape(*a.shape[:-1], a.shape[-1] // WORD, WORD), jnp.uint32)


def _shift(v, by: int):
    return v << by if by >= 0 else v >> -by


def _f16_pair(magnitudes, signs, offset: int):
    """The codes at bits offset..offset + 3 and offset + 16..offset + 19 of the words (bytes b and b + 2, offset =
    8b or 8b + 4) -> (low, high) float32, each 2^-14 times its E2M1 value. `magnitudes` / `signs`: the words with
    only the magnitude / sign bits of the codes of this nibble (low or high) kept; one shift of each and one
    combined mask serve both halves (the same nibble's codes of the other bytes that the shifts bring along land
    outside the mask, checked for every offset by the tests)."""
    keep = jnp.uint32(0x8E00 * 0x10001)  # bits 9..11 and 15 of each half
    halves = (_shift(magnitudes, 9 - offset) | _shift(signs, 12 - offset)) & keep
    as_f32 = lambda h: lax.bitcast_convert_type(h.astype(jnp.uint16), jnp.float16).astype(jnp.float32)  # noqa: E731
    return as_f32(halves), as_f32(halves >> 16)  # the cast to uint16 keeps the low half


def decode_words(words):
    """uint32 words [..., c] -> {byte position b: (even input's, odd input's) float32 [..., c]}, each 2^-14 times the
    E2M1 value of the low / high nibble of byte b (column 4w + b). For tests and the kernel alike."""
    low = words & jnp.uint32(0x07070707), words & jnp.uint32(0x08080808)  # even inputs: magnitudes, signs
    high = words & jnp.uint32(0x70707070), words & jnp.uint32(0x80808080)  # odd inputs
    out = {}
    for b in (0, 1):
        even_lo, even_hi = _f16_pair(*low, 8 * b)
        odd_lo, odd_hi = _f16_pair(*high, 8 * b + 4)
        out[b], out[b + 2] = (even_lo, odd_lo), (even_hi, odd_hi)
    return dict(sorted(out.items()))


def _load_words(ref, g, r0, c0, cols: int, rows: int = ROWS_PER_SCALE):
    """Rows r0 .. r0 + rows, words c0 .. c0 + cols of expert g's packed codes as uint32 [rows, cols], from a uint32
    (words) or uint8 (bytes) ref; bytes are joined into words in registers (no copy of the weights in memory)."""
    if ref.dtype == jnp.uint32:
        return ref[g, pl.ds(r0, rows), pl.ds(c0, cols)]
    b = ref[g, pl.ds(r0, rows), pl.ds(c0 * WORD, cols * WORD)].astype(jnp.uint32).reshape(rows, cols, WORD)
    shifts = lax.broadcasted_iota(jnp.uint32, (1, 1, WORD), 2) * jnp.uint32(8)
    return jnp.sum(b << shifts, axis=-1, dtype=jnp.uint32)


def _in_column_order(by_position):
    """{byte position b: [rows, c]} -> [rows, 4c] with column 4w + b (joins of pairs: what Triton lowers)."""
    even_b = jnp.stack([by_position[0], by_position[2]], axis=-1)  # [rows, c, 2]: byte 2h at [w, h]
    odd_b = jnp.stack([by_position[1], by_position[3]], axis=-1)
    joined = jnp.stack([even_b, odd_b], axis=-1)  # [rows, c, 2, 2]: byte 2h + q at [w, h, q]
    return joined.reshape(joined.shape[0], -1)


def kernel(group_ref, xe_ref, xo_ref, *refs, n_w: int, block_j: int, j_per_split: int):
    """Program (selection, column block, k split) of `launch`: one scale group (16 packed rows) a step."""
    del block_j
    w_refs, o_refs = refs[: 2 * n_w], refs[2 * n_w:]
    block_n = o_refs[0].shape[1]
    cols = block_n // WORD
    g = group_ref[0]
    n0 = pl.program_id(1) * block_n
    j_base = pl.program_id(2) * j_per_split
    inverse = 1.0 / F16_PER_E2M1

    def body(i, accs):
        j0 = pl.multiple_of(j_base + i * ROWS_PER_SCALE, ROWS_PER_SCALE)
        xe = xe_ref[0, pl.ds(j0, ROWS_PER_SCALE)].astype(jnp.float32)[:, None] * inverse
        xo = xo_ref[0, pl.ds(j0, ROWS_PER_SCALE)].astype(jnp.float32)[:, None] * inverse
        out = []
        for acc, p_ref, s_ref in zip(accs, w_refs[0::2], w_refs[1::2]):
            scale = e8m0_to_float_max(s_ref[g, pl.ds(j0 // ROWS_PER_SCALE, 1), pl.ds(n0, block_n)])  # [1, n]
            values = decode_words(_load_words(p_ref, g, j0, n0 // WORD, cols))
            lo = _in_column_order({b: even for b, (even, _) in values.items()})
            hi = _in_column_order({b: odd for b, (_, odd) in values.items()})
            out.append(acc + (xe * lo + xo * hi) * scale)
        return tuple(out)

    def store(o_ref, acc):
        o_ref[...] = jnp.sum(acc, axis=0, keepdims=True)

    write_tile(g, o_refs, j_per_split // ROWS_PER_SCALE, body, shape=(ROWS_PER_SCALE, block_n), store=store)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def grouped_gemv_words(x, ws, group, *, block_sizes, interpret=False):
    """`grouped_gemv_fp4` with decode "f16": ws = ((packed, scales uint8 [groups, k/32, n]), ...) with packed as
    bytes (uint8 [groups, k/2, n]) or words (uint32 [groups, k/2, n/4], `as_words`). Returns [selections, n] f32
    each."""
    per = WORD if ws[0][0].dtype == jnp.uint32 else 1
    for i, (p, s) in enumerate(ws):
        if p.dtype != ws[0][0].dtype or s.dtype != jnp.uint8 or p.shape[-1] * per != s.shape[-1]:
            raise ValueError(f"ws[{i}]: packed must be uint8 [.., n] or uint32 words [.., n/4] like ws[0], scales "
                             f"uint8 [.., n]; got {p.dtype}{list(p.shape)} and {s.dtype}{list(s.shape)}")
    block_n = min(block_sizes.block_n, ws[0][1].shape[-1])
    if block_n % WORD:
        raise ValueError(f"block_sizes.decode='f16' reads 4 columns a word: block_n={block_n} must be a multiple of "
                         f"{WORD}")
    return launch(kernel, x, ws, group, block_sizes, name="grouped_gemv_fp4", interpret=interpret,
                  columns_per_element=per)
