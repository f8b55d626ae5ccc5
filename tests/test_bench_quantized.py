"""scripts/bench_quantized.py's pass/fail logic (the GPU run itself is the lead's; a CPU smoke run of the whole
script, --smoke, takes ~12 minutes on 2 loaded cores, too long for CI)."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import bench_quantized as bq  # noqa: E402


def _res(cos, error=None):
    case = {"error": error} if error else {"ms": 1.0}
    check = {"fp8_fp4_vs_dequantized": {"finite": bool(np.isfinite(cos)), "cosine": cos}}
    return {"modes": {"bf16": {"decode": {"ms": 1.0}}, "fp8_fp4": {"decode": case}}, "checks": {"decode": check}}


def test_failures():
    assert bq.failures(_res(0.9999)) == []
    assert "cosine" in bq.failures(_res(0.5))[0]
    assert "cosine" in bq.failures(_res(float("nan")))[0]
    assert "boom" in bq.failures(_res(0.9999, error="RuntimeError: boom"))[0]


def test_compare():
    ref = np.random.default_rng(0).standard_normal((2, 50))
    same = bq.compare(ref, ref)
    assert same["cosine"] > 0.999999 and same["rel_err"] == 0 and same["argmax_equal"]
    assert bq.compare(-ref, ref)["cosine"] < -0.99
    assert not bq.compare(np.full_like(ref, np.nan), ref)["finite"]
