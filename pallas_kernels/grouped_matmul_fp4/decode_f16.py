"""The FP4 kernels' word-wise float16 decode (`decode="f16"`: the GEMV's default on every target, the tile kernel's at
16-row tiles, and at 64-row tiles on NVIDIA).

The byte-wise decodes (`gemv.py`: "quarter", "fp8") spend ~9.3 instructions per weight in the loop on sm90, most
of them integer work on one code at a time (each byte in its own register, masked and shifted twice). Here a
step's packed bytes are joined into uint32 words in registers (four columns a word: the shifts and ors of
consecutive bytes a thread already holds, which the compiler turns into plain word moves) and every mask and shift
works on two codes at once: the magnitude bits (e1 e0 m) of bytes b and b + 2 of a word (16 bits apart) go to bits
9..11 of their 16-bit halves and the sign bits to bit 15, which makes each half a float16 reading exactly 2^-14
times the code's E2M1 value (exponent field e; for e = 0 the float16 subnormal m/2 * 2^-14: no special case, unlike
the float32 placement of "quarter"). The conversion float16 -> float32 is one instruction per value on every GPU
(no FP8 or FP4 hardware needed: MI300 can use it too), the decoded values are joined back into column order, and
the kernels' inputs take the inverse factor 2^14 (a power of two: every product is bitwise the other decodes').

GEMV loop on sm90, gate + up at Flash dims (`scripts/sass_count.py`): 5.52 instructions per weight per thread at 4
warps, 5.35 at 2, against 9.28 for "quarter" and 9.77 for "fp8". Device time, batch 1 and 8: 1.34-1.42x faster
than "fp8" on an H100 (docs/benchmarks/fp4_words_h100/), the same on an H200 (docs/benchmarks/fp4_tile_h200/).
Storing the codes as words in memory was measured too and was no faster (and XLA's view of a byte array as words
is a copy, not a bitcast), so the weights stay bytes.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

WORD = 4  # packed bytes (columns) per uint32 word
F16_PER_E2M1 = 2.0**-14  # what an E2M1 code reads as once its bits sit in a float16 (`_f16_pair`)


def check_block_n(block_n: int, n: int) -> None:
    """A kernel decoding "f16" reads 4 columns a word: its column block must hold whole words."""
    if min(block_n, n) % WORD:
        raise ValueError(f"block_sizes.decode='f16' reads 4 columns a word: block_n={block_n} must be a multiple of "
                         f"{WORD}")


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
    E2M1 value of the low / high nibble of byte b (column 4w + b)."""
    low = words & jnp.uint32(0x07070707), words & jnp.uint32(0x08080808)  # even inputs: magnitudes, signs
    high = words & jnp.uint32(0x70707070), words & jnp.uint32(0x80808080)  # odd inputs
    out = {}
    for b in (0, 1):
        even_lo, even_hi = _f16_pair(*low, 8 * b)
        odd_lo, odd_hi = _f16_pair(*high, 8 * b + 4)
        out[b], out[b + 2] = (even_lo, odd_lo), (even_hi, odd_hi)
    return dict(sorted(out.items()))


def words_from_bytes(packed):
    """uint8 [rows, 4c] -> uint32 [rows, c]: byte b of word w is column 4w + b (little-endian). In registers, on a
    tile a kernel has loaded: no copy of the weights in memory."""
    rows, n = packed.shape
    b = packed.astype(jnp.uint32).reshape(rows, n // WORD, WORD)
    shifts = lax.broadcasted_iota(jnp.uint32, (1, 1, WORD), 2) * jnp.uint32(8)
    return jnp.sum(b << shifts, axis=-1, dtype=jnp.uint32)


def _in_column_order(by_position):
    """{byte position b: [rows, c]} -> [rows, 4c] with column 4w + b (joins of pairs: what Triton lowers)."""
    even_b = jnp.stack([by_position[0], by_position[2]], axis=-1)  # [rows, c, 2]: byte 2h at [w, h]
    odd_b = jnp.stack([by_position[1], by_position[3]], axis=-1)
    joined = jnp.stack([even_b, odd_b], axis=-1)  # [rows, c, 2, 2]: byte 2h + q at [w, h, q]
    return joined.reshape(joined.shape[0], -1)


def fp4_as_f16(packed):
    """uint8 [rows, n] packed E2M1 (even input in the low nibble; n % 4 == 0) -> (even, odd) float32 [rows, n],
    each 2^-14 (`F16_PER_E2M1`) times its code's value, through float16 (see the module docstring)."""
    values = decode_words(words_from_bytes(packed))
    even = _in_column_order({b: e for b, (e, _) in values.items()})
    odd = _in_column_order({b: o for b, (_, o) in values.items()})
    return even, odd
