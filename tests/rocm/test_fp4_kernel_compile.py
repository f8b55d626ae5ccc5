"""The FP4 grouped matmul (routed experts reading packed E2M1 + E8M0) compiles for gfx942, gfx950 and sm90 at
Flash dims within each target's LDS / shared memory and without register spills (pip `triton`, no GPU).

Not yet part of the steps `tests/rocm/test_kernel_compile.py` lowers (those take bf16 params); this lowers the
kernel alone, decode (6 one-row tiles, gate + up) and prefill (448 tiles of 64 rows, down).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest
from lone_kernel import compile_alone

from ds4jax.rocm_check.targets import TARGETS
from pallas_kernels.grouped_matmul_fp4 import BlockSizes, gemv_block_sizes, grouped_gemv_fp4, grouped_matmul_fp4
from pallas_kernels.grouped_matmul_fp4.gemv import converts_fp8

S = jax.ShapeDtypeStruct


def _args(rows, tiles, n_w, k, n):
    w = lambda: (S((256, k // 2, n), jnp.uint8), S((256, k // 32, n), jnp.uint8))
    return S((rows, k), jnp.bfloat16), tuple(w() for _ in range(n_w)), S((tiles,), jnp.int32)


CASES = {"decode_gate_up": _args(96, 6, 2, 4096, 2048), "prefill_down": _args(448 * 64, 448, 1, 2048, 4096)}


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dots", ["tile", "group", "tile_f16"])  # the default, the first kernel's per-group dots,
def test_fp4_kernel_compiles_within_limits(case, target, dots):  # and the word-wise float16 decode
    tile_m = 64 if case.startswith("prefill") else 16
    blocks = {"tile": BlockSizes.get_default(jnp.bfloat16, tile_m, arch=target),  # the target's default
              "group": BlockSizes(dots="group", decode="arith"),
              "tile_f16": BlockSizes(num_stages=2 if case.startswith("prefill") else 3, decode="f16")}[dots]
    compile_alone(functools.partial(grouped_matmul_fp4, block_sizes=blocks), CASES[case], target,
                  portable=dots != "tile")  # the default tile is the target's own


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_fp4_prefill_gate_up_default_compiles_within_limits(target):
    """Prefill's gate + up (two weights: the most shared memory) at the target's default tile: on sm90 the float16
    decode at 3 stages takes 80 KB of shared memory, which only NVIDIA gets (AMD keeps "bits" at 2 stages)."""
    blocks = BlockSizes.get_default(jnp.bfloat16, 64, arch=target)
    res = compile_alone(functools.partial(grouped_matmul_fp4, block_sizes=blocks),
                        _args(448 * 64, 448, 2, 4096, 2048), target, portable=False)
    assert res.lds <= 64 * 1024 or TARGETS[target].backend == "cuda", res


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("case", ["decode_gate_up", "decode_down"])
@pytest.mark.parametrize("blocks", [BlockSizes(), BlockSizes(dots="group", block_n=128)], ids=["tile", "group"])
def test_fp4_gemv_compiles_within_limits(case, target, blocks):
    """The decode form (`grouped_gemv_fp4`: one row per selection, no dot): batch 8's 48 selections."""
    k, n, n_w = (4096, 2048, 2) if case == "decode_gate_up" else (2048, 4096, 1)
    x, ws, _ = _args(48, 48, n_w, k, n)
    compile_alone(functools.partial(grouped_gemv_fp4, block_sizes=blocks), (x, ws, S((48,), jnp.int32)), target)


@pytest.mark.parametrize("target", [t for t in sorted(TARGETS) if converts_fp8(t)])
@pytest.mark.parametrize("case", ["decode_gate_up", "decode_down"])
def test_fp4_gemv_fp8_decode_compiles_where_it_can_run(case, target):
    """The FP8-conversion decode (selectable; the default before "f16"), on the targets that convert OCP FP8 (sm90,
    gfx950; not gfx942)."""
    k, n, n_w = (4096, 2048, 2) if case == "decode_gate_up" else (2048, 4096, 1)
    x, ws, _ = _args(48, 48, n_w, k, n)
    fn = functools.partial(grouped_gemv_fp4, block_sizes=dataclasses.replace(gemv_block_sizes(target), decode="fp8"))
    compile_alone(fn, (x, ws, S((48,), jnp.int32)), target)


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("case", ["decode_gate_up", "decode_down"])
@pytest.mark.parametrize("num_warps", [2, 4])
def test_fp4_gemv_word_decode_compiles_on_every_target(case, target, num_warps):
    """The word-wise float16 decode (`decode_f16.py`): integer ops, a float16 -> float32 conversion and no FP8 or FP4
    instruction, so every target (gfx942 included) can take it."""
    k, n, n_w = (4096, 2048, 2) if case == "decode_gate_up" else (2048, 4096, 1)
    x, ws, _ = _args(48, 48, n_w, k, n)
    blocks = BlockSizes(block_n=128, k_splits=16, dots="group", decode="f16", num_warps=num_warps)
    compile_alone(functools.partial(grouped_gemv_fp4, block_sizes=blocks), (x, ws, S((48,), jnp.int32)), target)


@pytest.mark.parametrize("target, stages", [("sm90", 3), ("gfx942", 2)])
def test_model_dispatch_hands_prefill_the_targets_fp4_tile(target, stages):
    """The routed experts' prefill (64-row tiles) through `routed_experts._grouped`, lowered as if on the target:
    NVIDIA gets the float16 decode at 3 stages, AMD "bits" at 2 (`BlockSizes.get_default`'s `arch`), and the
    kernel that compiles there is that tile (dispatch, not only the default table)."""
    from ds4jax.model.quantized import FP4_BLOCK, Format, QuantizedWeight
    from ds4jax.rocm_check.extract import triton_kernels
    from ds4jax.rocm_check.lowering import as_if_on
    from ds4jax.runtime import kernels, routed_experts

    gpu = TARGETS[target]
    x, ((values, scales),), tile_group = CASES["prefill_down"]
    w = QuantizedWeight(values, scales, Format.FP4, FP4_BLOCK)
    with as_if_on(gpu.target):
        lowered = jax.jit(lambda x, w, g: routed_experts._grouped(
            x, (w,), g, interpret=False, arch=kernels.kernel_arch(kernels.Impl.PALLAS))).trace(
            x, w, tile_group).lower(lowering_platforms=(gpu.lowering,))
    (kernel,) = triton_kernels(lowered)
    assert kernel.num_stages == stages, kernel.num_stages
    assert ("xf16>" in kernel.ttir) == (stages == 3)  # the word-wise decode goes through float16 tensors
    want = BlockSizes.get_default(jnp.bfloat16, 64, arch=target)
    assert (want.decode, want.num_stages) == (("f16", 3) if target == "sm90" else ("bits", 2))
