"""fp8_matmul kernel vs its reference on random block-scaled E4M3 weights, OCP and FNUZ: decode row counts (1, 8,
16: one row tile, k splits) and a prefill-like 100, with in / out not multiples of the tiles or the scale blocks.

The kernel reads no padding: tiles crossing an edge use masked loads (the interpreter fills the masked-off
elements with NaN before masking, so a wrong mask poisons the result); `test_edges_are_masked` checks that the
cases' edges matter by removing the masks. The reference is checked against the host dequantization
(`ds4jax.io.quant_formats`, validated against ml_dtypes).

`TestInterpret` runs on CPU (interpret mode); `TestDevice` (marker `device`) compiles the same kind of cases.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ds4jax.io import quant_formats as qf
from pallas_kernels import _backend
from pallas_kernels.fp8_matmul import BlockSizes, fp8_matmul, fp8_matmul_reference

OCP, FNUZ = "float8_e4m3fn", "float8_e4m3fnuz"


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    m: int
    k: int
    n: int
    fp8: str = OCP
    dtype: str = "float32"
    block: tuple[int, int] = (128, 128)
    block_sizes: BlockSizes | None = None

    def __str__(self):
        return self.name


CASES = [
    Case("m1_ragged_k_splits", 1, 180, 150, block_sizes=BlockSizes(block_k=32, block_n=32, k_splits=3)),
    Case("m8_fnuz", 8, 256, 96, fp8=FNUZ, block_sizes=BlockSizes(block_k=32, block_n=32)),
    Case("m16_small_blocks", 16, 70, 100, block=(16, 32), block_sizes=BlockSizes(block_k=16, block_n=32)),
    Case("m100_prefill_tiles", 100, 130, 70, block_sizes=BlockSizes(tile_m=32, block_k=32, block_n=32)),
    Case("m100_fnuz_bf16_defaults", 100, 160, 200, fp8=FNUZ, dtype="bfloat16"),
    Case("m8_bf16_defaults", 8, 300, 129, dtype="bfloat16"),
]


def make_inputs(case: Case, seed: int = 0):
    """x [m, k] and the weight quantized by the host quantizer (checkpoint [out, in] -> params [in, out])."""
    rng = np.random.default_rng(seed)
    bi, bo = case.block
    w = rng.standard_normal((case.n, case.k)) * np.exp2(rng.integers(-4, 4, (case.n, case.k)))
    q, s = qf.quantize_fp8(w.astype(np.float32), (bo, bi))
    values, scales = q.T.view(ml_dtypes.float8_e4m3fn), qf.e8m0_to_float(s).T.astype(np.float32)
    if case.fp8 == FNUZ:  # the loader's conversion: the same values with doubled scales
        fnuz, factor = qf.ocp_to_fnuz(values.view(np.uint8), np.ones((1,), np.float32))
        values, scales = fnuz.view(ml_dtypes.float8_e4m3fnuz), scales * factor[0]
    x = rng.standard_normal((case.m, case.k)).astype(np.float32)
    return jnp.asarray(x, case.dtype), jnp.asarray(values), jnp.asarray(scales)


def check(case: Case, interpret: bool):
    x, values, scales = make_inputs(case)
    got = fp8_matmul(x, values, scales, block=case.block, block_sizes=case.block_sizes, interpret=interpret)
    want = fp8_matmul_reference(x, values, scales, block=case.block)
    assert got.shape == (case.m, case.n) and got.dtype == jnp.float32
    got, want = np.asarray(got), np.asarray(want)
    assert np.isfinite(want).all() and np.isfinite(got).all()
    # the same products (the tile is dequantized exactly like the reference's weight); only the f32 sums reassociate
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def check_stacked(case: Case, interpret: bool, layers: int = 3, layer: int = 1):
    """The weight as layer `layer` of a stack whose other layers are NaN (values and scales): the kernel reads that
    layer in place, and nothing of the others (a scanned layer's FP8 linears: ds4jax/model/layer_stack.py)."""
    x, values, scales = make_inputs(case)
    nan_values = jnp.full(values.shape, jnp.nan, values.dtype)
    stack = jnp.stack([values if i == layer else nan_values for i in range(layers)])
    scale_stack = jnp.stack([scales if i == layer else jnp.full_like(scales, jnp.nan) for i in range(layers)])
    got = fp8_matmul(x, stack, scale_stack, block=case.block, block_sizes=case.block_sizes, interpret=interpret,
                     layer=jnp.int32(layer))
    want = np.asarray(fp8_matmul_reference(x, values, scales, block=case.block))
    np.testing.assert_allclose(np.asarray(fp8_matmul_reference(x, stack, scale_stack, block=case.block,
                                                               layer=jnp.int32(layer))), want, rtol=0, atol=0)
    got = np.asarray(got)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


class TestInterpret:
    @pytest.mark.parametrize("case", CASES, ids=str)
    def test_matches_reference(self, case):
        check(case, interpret=True)

    @pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[3]], ids=str)
    def test_stacked_weight_reads_its_layer_only(self, case):
        check_stacked(case, interpret=True)


@pytest.mark.device
class TestDevice:
    @pytest.mark.parametrize("case", [
        Case("decode_bf16", 8, 4096, 1000, dtype="bfloat16"),
        Case("decode_fnuz_bf16", 1, 1024, 4096, fp8=FNUZ, dtype="bfloat16"),
        Case("prefill_bf16", 300, 1000, 520, dtype="bfloat16"),
        Case("decode_f32", 16, 512, 384),
    ], ids=str)
    def test_matches_reference(self, case):
        check(case, interpret=False)

    @pytest.mark.parametrize("case", [Case("decode_stacked_bf16", 1, 1024, 4096, dtype="bfloat16"),
                                      Case("prefill_stacked_fnuz_bf16", 300, 1000, 520, fp8=FNUZ, dtype="bfloat16")],
                             ids=str)
    def test_stacked_weight_reads_its_layer_only(self, case):
        check_stacked(case, interpret=False)


def test_edges_are_masked(monkeypatch):
    """Without the masks the same call reads past the edges of x and the weight (the interpreter then shifts the
    slice back inside the array, reading other rows and columns) and the result is wrong: so the cases above, whose
    edges all cross tiles, check the masks. A masked-off element is never read: the interpreter fills it with NaN
    before masking, and the results above are finite."""
    case = CASES[0]
    x, values, scales = make_inputs(case)
    want = np.asarray(fp8_matmul_reference(x, values, scales, block=case.block))
    monkeypatch.setattr(_backend, "_tile_mask", lambda *a: None)
    jax.clear_caches()  # fp8_matmul is jitted: trace it again without the masks
    try:
        got = np.asarray(fp8_matmul(x, values, scales, block=case.block, block_sizes=case.block_sizes,
                                    interpret=True))
    finally:
        jax.clear_caches()
    assert not np.allclose(got, want, rtol=0, atol=1e-3 * np.abs(want).max())


def test_reference_is_the_host_dequantization():
    case = Case("ragged", 3, 70, 100, block=(16, 32))
    x, values, scales = make_inputs(case)
    q = np.asarray(values).view(np.uint8).T  # checkpoint orientation [out, in]
    exact = qf.dequant_fp8(q, np.asarray(scales).T, (32, 16)).T  # [in, out]
    got = fp8_matmul_reference(x, values, scales, block=case.block)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x) @ exact, rtol=1e-5, atol=1e-4)


def test_validation_names_the_argument():
    x, values, scales = jnp.zeros((4, 64)), jnp.zeros((64, 40), jnp.float8_e4m3fn), jnp.ones((1, 1), jnp.float32)
    with pytest.raises(ValueError, match="values"):
        fp8_matmul(x, values.astype(jnp.bfloat16), scales, interpret=True)
    with pytest.raises(ValueError, match="values"):
        fp8_matmul(jnp.zeros((4, 32)), values, scales, interpret=True)
    with pytest.raises(ValueError, match="scales"):
        fp8_matmul(x, values, jnp.ones((2, 1), jnp.float32), interpret=True)
    with pytest.raises(ValueError, match="scale block"):  # a tile must lie inside one scale block
        fp8_matmul(x, values, jnp.ones((8, 5), jnp.float32), block=(8, 8))
    with pytest.raises(ValueError, match=r"values .*\[layers"):  # a layer index needs a stack
        fp8_matmul(x, values, scales, interpret=True, layer=jnp.int32(0))
    with pytest.raises(ValueError, match="layer must be an integer scalar"):
        fp8_matmul(x, values[None], scales[None], interpret=True, layer=jnp.zeros((1,), jnp.int32))
    with pytest.raises(ValueError, match="values"):  # a stack needs the layer index
        fp8_matmul(x, values[None], scales[None], interpret=True)
