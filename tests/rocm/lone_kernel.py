"""One Pallas kernel lowered alone for a GPU target and compiled with pip `triton` on this host (no GPU): the check
the FP4 / FP8 kernel tests share for kernels the steps `test_kernel_compile.py` lowers do not reach (those take
bf16 params)."""

from __future__ import annotations

import jax
import pytest

from ds4jax.rocm_check import compile as triton_compile
from ds4jax.rocm_check.extract import triton_kernels
from ds4jax.rocm_check.report import violations
from ds4jax.rocm_check.targets import TARGETS


def compile_alone(fn, args, target: str, portable: bool = True):
    """`fn(*args)` (one kernel) compiled for `target` (a `TARGETS` name): asserts it stays within the target's
    limits, spills no register and (`portable`: a tile every target takes) fits MI300's 64 KB of LDS on every
    target; returns the compile's resources. Skips when the installed triton has no backend for the target."""
    gpu = TARGETS[target]
    try:
        backends = triton_compile.triton_backends()
    except triton_compile.TritonUnavailable as e:
        pytest.skip(str(e))
    if ("amd" if gpu.backend == "hip" else "nvidia") not in backends:
        pytest.skip(f"this triton wheel has no backend for {target}")
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=(gpu.lowering,))
    (kernel,) = triton_kernels(lowered)
    res = triton_compile.compile_kernel(kernel, gpu)
    assert violations(kernel, res, gpu) == []
    assert res.spills == 0 and (res.lds <= 64 * 1024 or not portable), res  # MI300's 64 KB on every target
    return res
