"""grouped_matmul_fp8 kernel vs its reference on random block-scaled E4M3 experts, OCP and FNUZ: decode-like (one or
two live rows per 16-row tile, k splits), prefill-like tiles, empty tiles, one or two weights, in / out dims not
multiples of the tiles or of the scale blocks (masked edges), several scale blocks per expert.

Memory the kernel must not read is NaN: the experts no tile selects (values and scales: FNUZ has no NaN byte the
decode would keep, its 0x80 reads 0) and the padding rows of x; reading either would reach a live row. The
reference itself is checked against the host dequantization (`ds4jax.io.quant_formats`, validated against
ml_dtypes).

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
from grouped_tiles import Case, check_outputs, padded_x
from pallas_kernels import _backend
from pallas_kernels.grouped_matmul_fp8 import BlockSizes, grouped_matmul_fp8, grouped_matmul_fp8_reference

OCP, FNUZ = "float8_e4m3fn", "float8_e4m3fnuz"


@dataclasses.dataclass(frozen=True)
class Fp8Case(Case):
    fp8: str = OCP
    block: tuple[int, int] = (128, 128)  # the scale block over [in, out]


CASES = [
    Fp8Case("decode_k_splits_two_scale_rows", groups=8, k=256, n=64, tile_m=16, tile_group=(5, 1),
            live_rows=(1, 1), block_sizes=BlockSizes(block_n=32, block_k=32, k_splits=2)),
    Fp8Case("decode_fnuz_ragged_dup_and_empty", groups=8, k=150, n=100, tile_m=16, tile_group=(0, 3, -1),
            live_rows=(2, 1, 0), fp8=FNUZ, block_sizes=BlockSizes(block_n=32, block_k=32)),
    Fp8Case("prefill_ragged_small_scale_blocks", groups=6, k=130, n=70, tile_m=32, tile_group=(2, 2, 4, -1),
            live_rows=(32, 7, 30, 0), n_w=1, block=(32, 16), block_sizes=BlockSizes(block_n=32, block_k=64)),
    Fp8Case("decode_bf16_defaults", groups=4, k=160, n=200, tile_m=16, tile_group=(3, 0), live_rows=(3, 16),
            dtype="bfloat16"),
    Fp8Case("prefill_fnuz_bf16_defaults", groups=5, k=256, n=96, tile_m=64, tile_group=(4, 1, -1),
            live_rows=(64, 5, 0), fp8=FNUZ, dtype="bfloat16"),
]


def make_inputs(case: Fp8Case, seed: int = 0):
    """x (NaN padding rows), each weight's experts quantized by the host quantizer (checkpoint [out, in] -> params
    [in, out]) with the unselected experts NaN, tile_group."""
    rng = np.random.default_rng(seed)
    x = padded_x(case, rng)
    bi, bo = case.block
    unused = [g for g in range(case.groups) if g not in case.tile_group]
    ws = []
    for _ in range(case.n_w):
        values, scales = [], []
        for _ in range(case.groups):  # magnitudes 2^-4 .. 2^3: the scale blocks differ
            w = rng.standard_normal((case.n, case.k)) * np.exp2(rng.integers(-4, 4, (case.n, case.k)))
            q, s = qf.quantize_fp8(w.astype(np.float32), (bo, bi))
            v, s = q.T.view(ml_dtypes.float8_e4m3fn), qf.e8m0_to_float(s).T.astype(np.float32)
            if case.fp8 == FNUZ:  # the loader's conversion: the same values with doubled scales
                fnuz, factor = qf.ocp_to_fnuz(v.view(np.uint8), np.ones((1,), np.float32))
                v, s = fnuz.view(ml_dtypes.float8_e4m3fnuz), s * factor[0]
            values.append(v)
            scales.append(s)
        values, scales = np.stack(values), np.stack(scales)
        values[unused] = np.nan  # OCP: 0x7F; FNUZ: 0x80 (which the kernel's decode reads as 0: the scales poison)
        scales[unused] = np.nan
        ws.append((jnp.asarray(values), jnp.asarray(scales)))
    return jnp.asarray(x, case.dtype), tuple(ws), jnp.asarray(case.tile_group, jnp.int32)


def check(case: Fp8Case, interpret: bool):
    x, ws, tg = make_inputs(case)
    assert all(v.dtype == jnp.dtype(case.fp8) for v, _ in ws)
    got = grouped_matmul_fp8(x, ws, tg, block=case.block, block_sizes=case.block_sizes, interpret=interpret)
    ref = grouped_matmul_fp8_reference(x, ws, tg, block=case.block)
    # the same products (tiles decoded exactly as the reference's weight); only the f32 sums reassociate
    check_outputs(got, ref, case, atol_relative_to_max=True)


class TestInterpret:
    @pytest.mark.parametrize("case", CASES, ids=str)
    def test_matches_reference(self, case):
        check(case, interpret=True)


@pytest.mark.device
class TestDevice:
    @pytest.mark.parametrize("case", [
        Fp8Case("flash_decode", groups=16, k=1024, n=512, tile_m=16, tile_group=(3, 9, 1, 15, 0, -1),
                live_rows=(1,) * 6, dtype="bfloat16"),
        Fp8Case("flash_prefill_fnuz", groups=8, k=512, n=256, tile_m=64, tile_group=(0, 0, 5, 7, -1),
                live_rows=(64, 9, 64, 3, 0), fp8=FNUZ, dtype="bfloat16"),
        Fp8Case("ragged_f32", groups=4, k=300, n=130, tile_m=16, tile_group=(2, -1), live_rows=(4, 0), n_w=1),
    ], ids=str)
    def test_matches_reference(self, case):
        check(case, interpret=False)


def test_edges_are_masked(monkeypatch):
    """Without the masks the ragged case reads past the k and n edges (the interpreter shifts the slice back inside
    the array, reading other rows and columns) and the result is wrong: so the ragged cases above check the masks."""
    case = CASES[1]
    x, ws, tg = make_inputs(case)
    (want, _) = grouped_matmul_fp8_reference(x, ws, tg, block=case.block)
    monkeypatch.setattr(_backend, "_tile_mask", lambda *a: None)
    jax.clear_caches()  # grouped_matmul_fp8 is jitted: trace it again without the masks
    try:
        (got, _) = grouped_matmul_fp8(x, ws, tg, block=case.block, block_sizes=case.block_sizes, interpret=True)
    finally:
        jax.clear_caches()
    live = np.asarray(tg).repeat(case.tile_m) >= 0
    live[16 + 1:32] = live[2:16] = False  # the padding rows
    got, want = np.asarray(got)[live], np.asarray(want)[live]
    assert not (np.isfinite(got).all() and np.allclose(got, want, rtol=0, atol=1e-3 * np.abs(want).max()))


def test_reference_is_the_host_dequantization():
    case = CASES[2]
    x, ws, tg = make_inputs(case)
    (y,) = grouped_matmul_fp8_reference(x, ws[:1], tg, block=case.block)
    values, scales = (np.asarray(a) for a in ws[0])
    bi, bo = case.block
    for t, g in enumerate(case.tile_group):
        if g < 0:
            continue
        rows = slice(t * case.tile_m, t * case.tile_m + case.live_rows[t])
        w = qf.dequant_fp8(values[g].view(np.uint8).T, scales[g].T, (bo, bi)).T  # [k, n]
        np.testing.assert_allclose(np.asarray(y)[rows], np.asarray(x)[rows] @ w, rtol=1e-5, atol=1e-4)


def test_validation_names_the_argument():
    x, tg = jnp.zeros((16, 64)), jnp.zeros((1,), jnp.int32)
    values, scales = jnp.zeros((2, 64, 40), jnp.float8_e4m3fn), jnp.ones((2, 1, 1), jnp.float32)
    with pytest.raises(ValueError, match="values"):
        grouped_matmul_fp8(x, ((values.astype(jnp.bfloat16), scales),), tg, interpret=True)
    with pytest.raises(ValueError, match="values"):
        grouped_matmul_fp8(jnp.zeros((16, 32)), ((values, scales),), tg, interpret=True)
    with pytest.raises(ValueError, match="scales"):
        grouped_matmul_fp8(x, ((values, scales[:, :, :0]),), tg, interpret=True)
    with pytest.raises(ValueError, match="scale block"):  # a tile must lie inside one scale block
        grouped_matmul_fp8(x, ((values, jnp.ones((2, 8, 5), jnp.float32)),), tg, block=(8, 8))
