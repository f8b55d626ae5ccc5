"""grouped_matmul_fp4 kernel vs its reference on random packed FP4 + E8M0 weights: decode-like (k splits, one row
per tile), prefill-like tiles, empty tiles, several weights. Unused experts' scales are E8M0 255 (NaN) and
padding rows are NaN: reading either would reach a live row. The reference itself is checked against the host
dequantization (`ds4jax.io.quant_formats`, validated against ml_dtypes).

`TestInterpret` runs on CPU (interpret mode); `TestDevice` (marker `device`) compiles the same cases on a GPU.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from ds4jax.io import quant_formats as qf
from grouped_tiles import Case, check_outputs, padded_x
from pallas_kernels.grouped_matmul_fp4 import BlockSizes, grouped_matmul_fp4, grouped_matmul_fp4_reference

CASES = [
    Case("decode_k_splits", groups=8, k=128, n=32, tile_m=16, tile_group=(5, 1), live_rows=(1, 1),
         block_sizes=BlockSizes(block_n=16, block_j=16, k_splits=2)),
    Case("decode_dup_and_empty", groups=8, k=64, n=32, tile_m=16, tile_group=(0, 3, -1), live_rows=(2, 1, 0),
         block_sizes=BlockSizes(block_n=32, block_j=32)),
    Case("prefill_tiles", groups=6, k=64, n=64, tile_m=32, tile_group=(2, 2, 4, -1), live_rows=(32, 7, 30, 0),
         n_w=1, block_sizes=BlockSizes(block_n=32, block_j=32, k_splits=1)),
    Case("bf16_default_blocks", groups=4, k=128, n=64, tile_m=16, tile_group=(3, 0), live_rows=(3, 16),
         dtype="bfloat16"),
    # a step of 4 scale groups in one dot per nibble: each scale row must reach its own 16 packed rows only
    Case("tile_dots_4_groups", groups=4, k=256, n=32, tile_m=16, tile_group=(1, -1, 3), live_rows=(5, 0, 16),
         block_sizes=BlockSizes(block_n=16, block_j=64, k_splits=2)),
]
# the first kernel's per-group dots and value-arithmetic decode stay selectable (timed against the defaults)
CASES += [dataclasses.replace(c, name=f"{c.name}_{dots}_{decode}",
                              block_sizes=dataclasses.replace(c.block_sizes or BlockSizes(), dots=dots, decode=decode))
          for c in (CASES[0], CASES[2], CASES[4]) for dots, decode in (("group", "bits"), ("group", "arith"),
                                                                      ("tile", "arith"), ("tile", "f16"),
                                                                      ("group", "f16"))]


def make_inputs(case: Case):
    rng = np.random.default_rng(0)
    x = padded_x(case, rng)
    unused = [g for g in range(case.groups) if g not in case.tile_group]
    ws = []
    for _ in range(case.n_w):
        packed, scales = [], []
        for _ in range(case.groups):  # each expert [n, k] in checkpoint orientation, at scales 2^-3 .. 2^2
            w = rng.standard_normal((case.n, case.k)) * np.exp2(rng.integers(-3, 3, (case.n, case.k // 32)))\
                .repeat(32, 1)
            p, s = qf.quantize_fp4(w)
            packed.append(p.T)
            scales.append(s.T)
        packed, scales = np.stack(packed), np.stack(scales)
        scales[unused] = 255  # E8M0 NaN
        ws.append((jnp.asarray(packed), jnp.asarray(scales)))
    return jnp.asarray(x, case.dtype), tuple(ws), jnp.asarray(case.tile_group, jnp.int32)


class Base:
    INTERPRET = True

    def check(self, case: Case):
        x, ws, tg = make_inputs(case)
        got = grouped_matmul_fp4(x, ws, tg, block_sizes=case.block_sizes, interpret=self.INTERPRET)
        ref = grouped_matmul_fp4_reference(x, ws, tg)
        check_outputs(got, ref, case, atol_relative_to_max=True)


class TestInterpret(Base):
    @pytest.mark.parametrize("case", CASES, ids=str)
    def test_matches_reference(self, case):
        self.check(case)


@pytest.mark.device
class TestDevice(Base):
    INTERPRET = False

    @pytest.mark.parametrize("case", [
        Case("flash_decode", groups=16, k=1024, n=512, tile_m=16, tile_group=(3, 9, 1, 15, 0, -1),
             live_rows=(1,) * 6, dtype="bfloat16"),
        Case("flash_prefill", groups=8, k=512, n=256, tile_m=64, tile_group=(0, 0, 5, 7, -1),
             live_rows=(64, 9, 64, 3, 0), dtype="bfloat16"),
        Case("flash_prefill_f16", groups=8, k=512, n=256, tile_m=64, tile_group=(0, 0, 5, 7, -1),
             live_rows=(64, 9, 64, 3, 0), dtype="bfloat16", block_sizes=BlockSizes(num_stages=2, decode="f16")),
        Case("flash_prefill_nvidia_default", groups=8, k=512, n=256, tile_m=64, tile_group=(0, 0, 5, 7, -1),
             live_rows=(64, 9, 64, 3, 0), dtype="bfloat16", block_sizes=BlockSizes.get_default("bfloat16", 64, "sm90")),
        Case("flash_decode_f16", groups=16, k=1024, n=512, tile_m=16, tile_group=(3, 9, 1, 15, 0, -1),
             live_rows=(1,) * 6, dtype="bfloat16", block_sizes=BlockSizes(decode="f16")),
    ], ids=str)
    def test_matches_reference(self, case):
        self.check(case)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dots", ["tile", "group"])
def test_f16_decode_gives_the_bits_decodes_bits(dots, dtype):
    """decode="f16" reads the weights at 2^-14 times their values and x at 2^14 times: every product, so every sum
    in the same order, is bitwise the "bits" decode's (no scaled weight here falls below float32's normals)."""
    case = dataclasses.replace(CASES[4], dtype=dtype)
    x, ws, tg = make_inputs(case)
    run = lambda decode: grouped_matmul_fp4(  # noqa: E731
        x, ws, tg, block_sizes=dataclasses.replace(case.block_sizes, dots=dots, decode=decode), interpret=True)
    for a, b in zip(run("f16"), run("bits")):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


@pytest.mark.parametrize("arch", [None, "sm90", "sm100", "gfx942", "gfx950"])
def test_default_decode_per_tile_height(arch):
    """The default (what the model's dispatch hands the kernel on `arch`) decodes "f16" at 16-row tiles everywhere
    (faster on an H200 at 8 tokens); at prefill's 64-row tiles "f16" at 3 stages on NVIDIA (as fast for gate + up,
    1.34x for down on an H200: docs/benchmarks/fp4_tile_h200/), "bits" at 2 stages elsewhere (not timed on AMD)."""
    assert BlockSizes.get_default(jnp.bfloat16, 16, arch=arch) == BlockSizes(decode="f16")
    nvidia = arch is not None and arch.startswith("sm")
    want = BlockSizes(decode="f16") if nvidia else BlockSizes(num_stages=2, decode="bits")
    assert BlockSizes.get_default(jnp.bfloat16, 64, arch=arch) == want


def test_f16_decode_needs_whole_words():
    x, ws, tg = make_inputs(CASES[0])
    with pytest.raises(ValueError, match="multiple of 4"):
        grouped_matmul_fp4(x, ws, tg, block_sizes=BlockSizes(block_n=6, block_j=16, decode="f16"), interpret=True)


def test_reference_is_the_host_dequantization():
    case = CASES[1]
    x, ws, tg = make_inputs(case)
    (y,) = grouped_matmul_fp4_reference(x, ws[:1], tg)
    packed, scales = (np.asarray(a) for a in ws[0])
    for t, g in enumerate(case.tile_group):
        rows = slice(t * case.tile_m, t * case.tile_m + case.live_rows[t])
        if g < 0:
            continue
        w = qf.dequant_fp4(packed[g].T, qf.e8m0_to_float(scales[g].T)).T  # [k, n]
        np.testing.assert_allclose(np.asarray(y)[rows], np.asarray(x)[rows] @ w, rtol=1e-5, atol=1e-4)


def test_validation_names_the_argument():
    x = jnp.zeros((16, 64))
    packed, scales = jnp.zeros((2, 32, 16), jnp.uint8), jnp.zeros((2, 2, 16), jnp.uint8)
    with pytest.raises(ValueError, match="multiple of 32"):
        grouped_matmul_fp4(jnp.zeros((16, 48)), ((packed, scales),), jnp.zeros((1,), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="scales"):
        grouped_matmul_fp4(x, ((packed, scales[:, :1]),), jnp.zeros((1,), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="dots must be one of"):
        grouped_matmul_fp4(x, ((packed, scales),), jnp.zeros((1,), jnp.int32), interpret=True,
                           block_sizes=BlockSizes(dots="rows"))
