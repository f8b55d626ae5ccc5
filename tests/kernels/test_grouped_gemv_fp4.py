"""grouped_gemv_fp4 (one row per expert selection, no dot: the decode form) vs its reference on random packed FP4 +
E8M0 weights: k splits, repeated experts, empty selections (group -1: NaN rows, zeros out, no weight read), several
weights, bf16 and f32 rows. Unused experts' scales are E8M0 255 (NaN): reading one would reach a live row.

`TestInterpret` runs on CPU (interpret mode); `TestDevice` (marker `device`) compiles the same cases on a GPU.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from grouped_tiles import Case, check_outputs
from pallas_kernels.grouped_matmul_fp4 import decode_f16
from pallas_kernels.grouped_matmul_fp4 import (BlockSizes, gemv_block_sizes, grouped_gemv_fp4,
                                               grouped_gemv_fp4_reference, grouped_matmul_fp4)
from test_grouped_matmul_fp4 import make_inputs

CASES = [
    Case("k_splits", groups=8, k=128, n=32, tile_m=1, tile_group=(5, 1, 6), live_rows=(1, 1, 1),
         block_sizes=BlockSizes(block_n=16, block_j=16, k_splits=2)),
    Case("repeated_and_empty", groups=8, k=64, n=32, tile_m=1, tile_group=(0, 3, -1, 3), live_rows=(1, 1, 0, 1),
         block_sizes=BlockSizes(block_n=32, block_j=32)),
    Case("four_scale_groups_per_step", groups=4, k=256, n=32, tile_m=1, tile_group=(1, -1, 3), live_rows=(1, 0, 1),
         n_w=1, block_sizes=BlockSizes(block_n=16, block_j=64, k_splits=2)),
    Case("group_steps", groups=8, k=128, n=32, tile_m=1, tile_group=(5, -1, 1, 5), live_rows=(1, 0, 1, 1),
         block_sizes=BlockSizes(block_n=16, dots="group", k_splits=2)),
    Case("group_steps_bf16", groups=4, k=256, n=64, tile_m=1, tile_group=(3, 0, 2), live_rows=(1, 1, 1),
         n_w=1, dtype="bfloat16", block_sizes=BlockSizes(dots="group")),
    Case("bf16_default_blocks", groups=4, k=128, n=64, tile_m=1, tile_group=(3, 0, 2, 1, 0, 3),
         live_rows=(1,) * 6, dtype="bfloat16"),
    Case("fp8_decode", groups=8, k=128, n=32, tile_m=1, tile_group=(5, -1, 1, 5), live_rows=(1, 0, 1, 1),
         block_sizes=BlockSizes(block_n=16, dots="group", decode="fp8", k_splits=2)),
    Case("fp8_decode_bf16", groups=4, k=256, n=64, tile_m=1, tile_group=(3, 0, 2), live_rows=(1, 1, 1),
         n_w=1, dtype="bfloat16", block_sizes=BlockSizes(dots="group", decode="fp8")),
    Case("f16_decode", groups=8, k=128, n=32, tile_m=1, tile_group=(5, -1, 1, 5), live_rows=(1, 0, 1, 1),
         block_sizes=BlockSizes(block_n=16, dots="group", decode="f16", k_splits=2)),
    Case("f16_decode_bf16_two_blocks", groups=4, k=256, n=256, tile_m=1, tile_group=(3, 0, -1, 2),
         live_rows=(1, 1, 0, 1), n_w=1, dtype="bfloat16", block_sizes=BlockSizes(dots="group", decode="f16")),
]


class Base:
    INTERPRET = True

    def check(self, case: Case):
        x, ws, group = make_inputs(case)
        got = grouped_gemv_fp4(x, ws, group, block_sizes=case.block_sizes, interpret=self.INTERPRET)
        check_outputs(got, grouped_gemv_fp4_reference(x, ws, group), case, atol_relative_to_max=True)


class TestInterpret(Base):
    @pytest.mark.parametrize("case", CASES, ids=str)
    def test_matches_reference(self, case):
        self.check(case)


@pytest.mark.device
class TestDevice(Base):
    INTERPRET = False

    @pytest.mark.parametrize("case", [
        Case("flash_decode", groups=16, k=1024, n=512, tile_m=1, tile_group=(3, 9, 1, 15, 0, -1),
             live_rows=(1,) * 5 + (0,), dtype="bfloat16"),
        *CASES,
    ], ids=str)
    def test_matches_reference(self, case):
        self.check(case)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_decode_gives_the_same_bits(dtype):
    """The decodes read the weights at different powers of two (1, 1/4, 2^-6, 2^-14) and the inputs take the inverse:
    every product, so every sum, is bitwise the same (same order of operations)."""
    case = Case("fp8_vs_bits", groups=8, k=256, n=64, tile_m=1, tile_group=(5, -1, 1, 5, 7), live_rows=(1, 0, 1, 1, 1),
                dtype=dtype)
    x, ws, group = make_inputs(case)
    run = lambda decode: grouped_gemv_fp4(  # noqa: E731
        x, ws, group, block_sizes=BlockSizes(block_n=32, dots="group", decode=decode, k_splits=2), interpret=True)
    first = run("bits")
    for decode in ("quarter", "fp8", "f16"):
        for a, b in zip(run(decode), first):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


def test_word_decode_reads_every_byte_of_every_position():
    """`decode_f16.decode_words`: each of the 256 byte values at each of the 4 byte positions of a word (the other
    three positions holding other values) gives its two codes' E2M1 values times 2^-14, signed zeros included: the
    shifts that decode two positions at once never let a neighbour's bits in."""
    table = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    byte = np.arange(256, dtype=np.uint8)
    columns = np.stack([byte, byte[::-1], np.roll(byte, 85), np.roll(byte, 170)], axis=-1)  # [256 words, 4 bytes]
    decoded = decode_f16.decode_words(jnp.asarray(columns.reshape(-1).view(np.uint32)))
    assert sorted(decoded) == [0, 1, 2, 3]
    for b, (even, odd) in decoded.items():
        for got, codes in ((even, columns[:, b] & 15), (odd, columns[:, b] >> 4)):
            got = np.asarray(got) * 2.0**14
            np.testing.assert_array_equal(got, table[codes])
            np.testing.assert_array_equal(np.signbit(got), np.signbit(table[codes]))


def test_word_decode_keeps_column_order():
    """`decode_f16.fp4_as_f16` on a loaded tile of packed bytes: column c of the even / odd output is the low / high
    nibble of byte c, times 2^-14, signed zeros included (the words' byte positions joined back in order)."""
    table = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    packed = np.random.default_rng(0).integers(0, 256, size=(16, 64), dtype=np.uint8)
    even, odd = decode_f16.fp4_as_f16(jnp.asarray(packed))
    for got, codes in ((even, packed & 15), (odd, packed >> 4)):
        got = np.asarray(got) * 2.0**14
        np.testing.assert_array_equal(got, table[codes])
        np.testing.assert_array_equal(np.signbit(got), np.signbit(table[codes]))


def test_word_decode_needs_whole_words():
    x, ws, group = make_inputs(CASES[0])
    with pytest.raises(ValueError, match="multiple of 4"):
        grouped_gemv_fp4(x, ws, group, block_sizes=BlockSizes(block_n=6, dots="group", decode="f16"), interpret=True)


@pytest.mark.parametrize("arch", ["gfx950", "sm90", "sm89", "sm100", "gfx942", "sm80", None])
def test_gemv_tiles_per_arch(arch):
    """The word-wise float16 decode everywhere (faster than "fp8" and "quarter" on an H100: fp4_words_h100/)."""
    assert gemv_block_sizes(arch).decode == "f16"


def test_fp8_decode_refused_where_it_does_not_apply():
    x, ws, group = make_inputs(CASES[0])
    for decode in ("fp8", "quarter"):
        with pytest.raises(ValueError, match="needs dots='group'"):
            grouped_gemv_fp4(x, ws, group, block_sizes=BlockSizes(decode=decode), interpret=True)
        with pytest.raises(ValueError, match="GEMV's"):
            grouped_matmul_fp4(x, ws, group, block_sizes=BlockSizes(dots="group", decode=decode), interpret=True)


def test_validation_names_the_argument():
    packed, scales = jnp.zeros((2, 32, 16), jnp.uint8), jnp.zeros((2, 2, 16), jnp.uint8)
    with pytest.raises(ValueError, match="group must be"):
        grouped_gemv_fp4(jnp.zeros((3, 64)), ((packed, scales),), jnp.zeros((2,), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="multiple of 32"):
        grouped_gemv_fp4(jnp.zeros((2, 48)), ((packed, scales),), jnp.zeros((2,), jnp.int32), interpret=True)
