"""scripts/bench_mhc.py can fail: every timed variant of the mHC pre-step is compared with the reference first, and
one that disagrees (or errors) makes the run exit 1 with the record kept. CPU, interpret mode, a narrow hidden
size, one variant."""

import importlib.util
import json
import os
import sys

import jax.numpy as jnp
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--interpret", "--hidden", "32", "--tokens", "2", "--iters", "1", "--variants", "fused default"]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_mhc", os.path.join(ROOT, "scripts", "bench_mhc.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _run(bench, tmp_path):
    out = tmp_path / "mhc.json"
    code = bench.main([*ARGS, "--out", str(out)])
    return code, json.loads(out.read_text())


def test_an_agreeing_kernel_passes(bench, tmp_path):
    code, res = _run(bench, tmp_path)
    assert code == 0 and [c["check"] for c in res["cases"]] == ["pass"], res


def test_a_kernel_that_disagrees_fails_the_run(bench, tmp_path, monkeypatch):
    real = bench.mhc_pre
    monkeypatch.setattr(bench, "mhc_pre", lambda *a, **k: tuple(
        y * jnp.asarray(1.001, y.dtype) if y.dtype == jnp.float32 else y for y in real(*a, **k)))  # gates 0.1 % off
    code, res = _run(bench, tmp_path)
    assert code == 1 and "max error" in res["cases"][0]["check"] and res["failures"], res


def test_an_erroring_variant_fails_the_run(bench, tmp_path, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(bench, "mhc_pre", broken)
    code, res = _run(bench, tmp_path)
    assert code == 1 and "no kernel today" in res["cases"][0]["error"], res
