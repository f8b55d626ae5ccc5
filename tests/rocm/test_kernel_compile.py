"""Every Pallas kernel of the Flash and Pro steps compiles for gfx942, gfx950 and sm90 within its LDS limit.

The kernels are found, not listed: each step (decode and prefill, bf16 and fp32) is lowered as if on the target
and every Triton module in it (one per `pallas_call`) is compiled by the pip `triton` wheel with the launch
parameters Pallas chose. A kernel added to the dispatcher is covered without touching this file.
The committed report `docs/benchmarks/rocm_kernels.md` must be what `scripts/rocm_kernels.py` writes today.

Compiling is deterministic in (Triton IR, launch parameters, target, Triton version), and the script records each
compiled kernel's resources under that key in rocm_kernels.json. So the tests lower every step for real (that is
what changes when a kernel or a tile does), compile for real only kernels whose key is not recorded (a changed
kernel: the report is then stale and the test says so), and compile the sparse-attention and indexer kernels of
every target again to check that the records are what Triton gives today. That is two CPU minutes less per run
than compiling all 158 kernels; `DS4JAX_ROCM_RECOMPILE=1` compiles every one.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import platform

import jax
import jax.numpy as jnp
import pytest

from ds4jax.rocm_check import compile as triton_compile
from ds4jax.rocm_check.extract import triton_kernels
from ds4jax.rocm_check.lowering import CASES, PUBLISHED_CASES
from ds4jax.rocm_check.report import check, render, rows_for, tile_comparison
from ds4jax.rocm_check.targets import GFX942, GFX950, TARGETS
from pallas_kernels import SparseAttentionBlockSizes, sparse_attention

REPORT = pathlib.Path(__file__).parents[2] / "docs" / "benchmarks" / "rocm_kernels.md"
RECORDS = REPORT.with_suffix(".json")
SPOT_CHECKED = ("sparse_attention", "indexer_score_select")  # compiled again for real on every target
WHEEL_PLATFORM = platform.system() == "Linux" and platform.machine() == "x86_64"  # where the test extra has it


def _needs(backend: str):
    try:
        have = triton_compile.triton_backends()
    except triton_compile.TritonUnavailable as e:
        if WHEEL_PLATFORM:  # the test extra installs it here: a missing wheel is a broken environment
            raise
        pytest.skip(f"no pip triton wheel for {platform.system()}/{platform.machine()}: {e}")
    if backend not in have:
        pytest.skip(f"this triton wheel has no {backend} backend (has {sorted(have)})")


def _recorded():
    """Compile with the records of rocm_kernels.json (nothing recorded under DS4JAX_ROCM_RECOMPILE=1)."""
    if os.environ.get("DS4JAX_ROCM_RECOMPILE", "0") not in ("", "0"):
        return triton_compile.recorded({})
    return triton_compile.recorded(json.loads(RECORDS.read_text()).get("resources", {}))


def _spot_check(rows) -> None:
    """The records are what Triton gives today: the first kernel of each SPOT_CHECKED name, compiled again."""
    for name in SPOT_CHECKED:
        row = next(r for r in rows if r.kernel.name == name)
        again = triton_compile.compile_kernel(row.kernel, TARGETS[row.target], fresh=True)
        assert again == row.resources, (row.target, name, again, row.resources)


def _triton_matches_records() -> bool:
    import triton

    return triton.__version__ == triton_compile.TRITON_VERSION


@pytest.mark.slow
def test_every_kernel_compiles_within_limits_and_the_report_is_current():
    """One test for all targets: lowering (and compiling what is not recorded) once feeds both checks."""
    _needs("amd")
    _needs("nvidia")
    with _recorded() as book:
        rows = {name: rows_for(gpu, CASES + PUBLISHED_CASES) for name, gpu in TARGETS.items()}
        comparison = tile_comparison()
    for name, got in rows.items():
        names = {r.kernel.name for r in got}
        # what today's steps dispatch (more may appear; none may vanish unnoticed)
        want = {"sparse_attention", "indexer_score_select", "indexer_rank", "grouped_matmul", "mhc_pre", "mhc_head"}
        assert want <= names, (name, names)
        # the published format: the FP8 dense linears, the FP4 experts' GEMV at decode and tile kernel at prefill
        published = {r.kernel.name for r in got if r.case.weights == "published"}
        assert {"fp8_matmul", "grouped_gemv_fp4", "grouped_matmul_fp4"} <= published, (name, published)
        for case in {r.case for r in got}:
            assert {"sparse_attention", "indexer_score_select", "mhc_pre"} <= {
                r.kernel.name for r in got if r.case == case}
    assert check([r for got in rows.values() for r in got]) == []

    # the ROCm tiles earn their place: never more spilled VGPRs than the H200 tile on the same target
    spills = {(name, dtype, label, k.name): res.spills for name, dtype, label, k, res in comparison}
    for (name, dtype, label, kernel), n in spills.items():
        if label == "ROCm tile":
            assert n <= spills[(name, dtype, "H200 tile", kernel)], (name, dtype, kernel)
    assert spills[("gfx942", "bf16", "ROCm tile", "sparse_attention")] == 0

    for got in rows.values():
        _spot_check(got)

    if not _triton_matches_records():
        pytest.skip(f"the report is pinned to triton {triton_compile.TRITON_VERSION}")
    stale = "stale report: run `JAX_PLATFORMS=cpu python scripts/rocm_kernels.py`"
    assert not book.misses or not book.resources, f"{len(book.misses)} kernels have no record; {stale}"
    assert REPORT.read_text() == render(rows, comparison), stale


@pytest.mark.slow
def test_fp8_kv_kernels_compile_within_limits():
    """The Flash decode step with the FP8 KV cache: its attention and indexer kernels read FNUZ bytes on gfx942 and
    OCP E4M3 on gfx950 / sm90, and compile within each target's LDS / shared memory (about 45 CPU seconds)."""
    _needs("amd")
    _needs("nvidia")
    from ds4jax.rocm_check.lowering import FP8_KV_CASES, lower_step

    (case,) = FP8_KV_CASES
    for name, gpu in TARGETS.items():
        text = lower_step(case, gpu).as_text()
        assert ("f8E4M3FNUZ" in text) == (name == "gfx942") and "f8E4M3FN" in text, name  # the pools as stored
        with _recorded() as book:
            rows = [r for r in rows_for(gpu, [case]) if r.kernel.name in SPOT_CHECKED]
        assert {r.kernel.name for r in rows} == set(SPOT_CHECKED)
        assert check(rows) == [], name
        if name == "gfx942":  # the FNUZ kernels, compiled again
            _spot_check(rows)
        if _triton_matches_records():
            assert not book.misses or not book.resources, "stale records: run `python scripts/rocm_kernels.py`"


def test_published_weights_lower_in_each_targets_fp8():
    """Flash's decode step with its weights as published (FP8 dense + FP4 experts): FNUZ E4M3 on gfx942 (MI300
    converts nothing else), OCP on gfx950 and sm90; the FP4 GEMV decodes through float16 on every target (the
    word-wise decode: no FP8 conversion in its kernel)."""
    from ds4jax.rocm_check.lowering import lower_step

    case = next(c for c in PUBLISHED_CASES if c.shape == "decode")
    for name, gpu in TARGETS.items():
        lowered = lower_step(case, gpu)
        text = lowered.as_text()
        fnuz, ocp = "xf8E4M3FNUZ>" in text, "xf8E4M3FN>" in text  # the weights' element types
        assert fnuz == (name == "gfx942") and ocp == (name != "gfx942"), name
        gemv = [k for k in triton_kernels(lowered) if k.name == "grouped_gemv_fp4"]
        assert gemv and all("f8E4M3" not in k.ttir and "f16" in k.ttir for k in gemv), name


def test_an_oversized_tile_fails_the_check():
    """The check itself: 128-row bf16 blocks need more LDS than MI300's 64 KiB (and fit MI355's 160 KiB)."""
    _needs("amd")
    S = jax.ShapeDtypeStruct
    big = SparseAttentionBlockSizes(block_h=16, block_k=128, num_warps=8, num_stages=1, num_splits=1)
    fn = functools.partial(sparse_attention, scale=512**-0.5, block_sizes=big)
    args = (S((8, 64, 512), jnp.bfloat16), S((1032, 512), jnp.bfloat16), S((8, 128), jnp.int32),
            S((8192, 512), jnp.bfloat16), S((8, 512), jnp.int32), S((64,), jnp.float32))
    (kernel,) = triton_kernels(jax.jit(fn).trace(*args).lower(lowering_platforms=("rocm",)))
    on_mi300 = triton_compile.compile_kernel(kernel, GFX942)
    problems = triton_compile.violations(kernel, on_mi300, GFX942)
    assert on_mi300.lds > GFX942.local_memory and len(problems) == 1 and "gfx942" in problems[0], (on_mi300, problems)
    assert triton_compile.violations(kernel, triton_compile.compile_kernel(kernel, GFX950), GFX950) == []
