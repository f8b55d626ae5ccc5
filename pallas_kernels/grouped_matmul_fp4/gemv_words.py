"""The FP4 GEMV reading its weights as 32-bit words and decoding them through float16 (`decode="f16"`).

The byte-wise decodes (`gemv.py`: "quarter", "fp8") spend ~9.3 instructions per weight in the loop on sm90, most
of them integer work on one code at a time (each byte extracted into its own register, then masked and shifted
twice). Here the packed bytes are read as uint32 words (four columns a word; a free bitcast of the same bytes) and
every mask and shift works on two codes at once: the magnitude bits (e1 e0 m) of bytes b and b + 2 of a word (16
bits apart) go to bits 9..11 of their 16-bit halves and the sign bits to bit 15, which makes each half a float16
reading exactly 2^-14 times the code's E2M1 value (exponent field e; for e = 0 the float16 subnormal m/2 * 2^-14:
no special case, unlike the float32 placement of "quarter"). The conversion float16 -> float32 is one instruction
per value on every GPU (sm90 reads either half of a register; no FP8 or FP4 hardware needed, so MI300 can use it
too), and the inputs take the inverse factor 2^14 (a power of two: every product is bitwise the other decodes').

A program keeps one accumulator per byte position of the words (columns 4w + b), and writes its block's columns
grouped by byte position; the wrapper puts them back in order (fused with the k splits' sum).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._mxfp4 import e8m0_to_float_max
from pallas_kernels.grouped_matmul_fp4.launch import ROWS_PER_SCALE, launch

WORD = 4  # packed bytes (columns) per uint32 word
F16_PER_E2M1 = 2.0**-14  # what an E2M1 code reads as once its bits sit in a float16 (`_f16_pair`)


def as_words(a):
    """uint8 [..., n] -> uint32 [..., n / 4], the same bytes: byte b of word w is column 4w + b (little-endian, as
    every GPU JAX runs on). NOT free in XLA: a bitcast-convert to a wider type is expanded into shifts and ors, a
    copy of the whole array (seen in XLA:CPU's optimized HLO), so a caller whose weights are stored as bytes pays a
    copy of them per call; weights kept as words (`grouped_gemv_words`) do not."""
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


def _scales(s_words):
    """E8M0 scale words [1, c] -> {byte position b: float32 [1, c]}."""
    return {b: e8m0_to_float_max((s_words >> (8 * b)) & jnp.uint32(0xFF)) for b in range(WORD)}


def kernel(group_ref, xe_ref, xo_ref, *refs, n_w: int, block_j: int, j_per_split: int):
    """Program (selection, column block, k split) of `launch` with word views of the weights: one scale group (16
    packed rows) a step; writes its block's columns as [byte 0 columns, byte 1 columns, ...]."""
    del block_j
    w_refs, o_refs = refs[: 2 * n_w], refs[2 * n_w:]
    block_n = o_refs[0].shape[1]
    cols = block_n // WORD
    g = group_ref[0]
    c0 = pl.program_id(1) * cols
    j_base = pl.program_id(2) * j_per_split
    inverse = 1.0 / F16_PER_E2M1

    def body(i, accs):
        j0 = pl.multiple_of(j_base + i * ROWS_PER_SCALE, ROWS_PER_SCALE)
        xe = xe_ref[0, pl.ds(j0, ROWS_PER_SCALE)].astype(jnp.float32)[:, None] * inverse
        xo = xo_ref[0, pl.ds(j0, ROWS_PER_SCALE)].astype(jnp.float32)[:, None] * inverse
        out = []
        for acc, p_ref, s_ref in zip(accs, w_refs[0::2], w_refs[1::2]):
            scale = _scales(s_ref[g, pl.ds(j0 // ROWS_PER_SCALE, 1), pl.ds(c0, cols)])
            values = decode_words(p_ref[g, pl.ds(j0, ROWS_PER_SCALE), pl.ds(c0, cols)])
            out.append(tuple(a + (xe * even + xo * odd) * scale[b]
                             for a, (b, (even, odd)) in zip(acc, values.items())))
        return tuple(out)

    def store(accs):
        for o_ref, acc in zip(o_refs, accs):
            for b, a in enumerate(acc):
                o_ref[:, pl.ds(b * cols, cols)] = jnp.sum(a, axis=0, keepdims=True)

    zeros = lambda: tuple(tuple(jnp.zeros((ROWS_PER_SCALE, cols), jnp.float32) for _ in range(WORD))  # noqa: E731
                          for _ in o_refs)

    @pl.when(g >= 0)
    def _():  # a static trip count: Triton software-pipelines the weight loads
        store(lax.fori_loop(0, j_per_split // ROWS_PER_SCALE, body, zeros()))

    @pl.when(g < 0)
    def _():  # an empty selection reads no weight
        store(zeros())


def columns_in_order(y, block_n: int):
    """[rows, n] with each block's columns grouped by byte position (the kernel's output) -> columns in order."""
    rows, n = y.shape
    return y.reshape(rows, n // block_n, WORD, block_n // WORD).swapaxes(2, 3).reshape(rows, n)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def grouped_gemv_words(x, words, group, *, block_sizes, interpret=False):
    """`grouped_gemv_fp4` with decode "f16" on weights already in words: ((packed [groups, k/2, n/4] uint32,
    scales [groups, k/32, n/4] uint32), ...), `as_words` of the byte arrays. Returns [selections, n] f32 each."""
    for i, (p, s) in enumerate(words):
        if p.dtype != jnp.uint32 or s.dtype != jnp.uint32 or p.shape[-1] != s.shape[-1]:
            raise ValueError(f"words[{i}] must be uint32 (packed, scales) with the same last axis, got "
                             f"{p.dtype}{list(p.shape)} and {s.dtype}{list(s.shape)}")
    block_n = min(block_sizes.block_n, words[0][0].shape[-1] * WORD)
    out = launch(kernel, x, words, group, block_sizes, name="grouped_gemv_fp4", interpret=interpret,
                 columns_per_element=WORD)
    return tuple(columns_in_order(y, block_n) for y in out)
