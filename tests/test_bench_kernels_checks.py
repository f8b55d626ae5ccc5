"""scripts/bench_kernels.py can fail: every timed case is compared with its XLA reference, and a kernel that
disagrees (or a case that errors) makes the run exit 1, while the records are still written. On CPU in interpret
mode with the script's tiny dims, Sinkhorn only (the cheapest op), one batch."""

import importlib.util
import json
import os
import sys

import jax.numpy as jnp
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_kernels", os.path.join(ROOT, "scripts", "bench_kernels.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def _run(bench, tmp_path):
    out = tmp_path / "kernels"
    code = bench.main(["--interpret", "--ops", "sinkhorn", "--batches", "2", "--iters", "1", "--no-ref",
                       "--out", str(out)])
    return code, json.loads(out.with_suffix(".json").read_text())["records"]


def test_agreeing_kernels_pass(bench, tmp_path):
    code, records = _run(bench, tmp_path)
    assert code == 0 and records and all(r["check"]["ok"] for r in records), records


def test_a_kernel_that_disagrees_fails_the_run(bench, tmp_path, monkeypatch):
    real = bench.sinkhorn
    monkeypatch.setattr(bench, "sinkhorn", lambda *a, **k: real(*a, **k) * jnp.float32(1.01))  # 1 % off
    code, records = _run(bench, tmp_path)
    assert code == 1 and any(r["check"]["ok"] is False for r in records), records
    assert "**FAILED**" in (tmp_path / "kernels.md").read_text()


def test_an_erroring_case_fails_the_run(bench, tmp_path, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(bench, "sinkhorn", broken)
    code, records = _run(bench, tmp_path)
    assert code == 1 and all("no kernel today" in r["error"] for r in records), records


def test_a_disagreeing_fp4_grouped_matmul_fails_the_run(bench, tmp_path, monkeypatch):
    """The routed-expert cases are checked too (against the jnp reference, tile by tile)."""
    real = bench.grouped_matmul_fp4
    monkeypatch.setattr(bench, "grouped_matmul_fp4", lambda *a, **k: tuple(y * 1.01 for y in real(*a, **k)))
    out = tmp_path / "kernels"
    code = bench.main(["--interpret", "--ops", "fp4_down", "--batches", "1", "--iters", "1", "--out", str(out)])
    records = json.loads(out.with_suffix(".json").read_text())["records"]
    assert code == 1 and records and all(r["check"]["ok"] is False for r in records), records
