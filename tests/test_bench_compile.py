"""scripts/bench_compile.py's record logic on the tiny config (no timings asserted): a compiled program is an ok
record with every field the tables need, a failure or a measurement cut by --deadline-s is an error record and a
non-zero exit, and the markdown is generated from the JSON. Subprocesses: the script sets cache variables in its
own environment."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "bench_compile.py")


def bench(tmp_path, *args):
    out = tmp_path / "compile.json"
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, SCRIPT, "--config", "tiny", "--layers", "2", "--programs", "decode",
                           "--kernels", "reference", "--out", str(out), *args],
                          capture_output=True, text=True, env=env, timeout=300)
    data = json.loads(out.read_text())
    return proc, data, (tmp_path / "compile.md").read_text()


def test_ok_record(tmp_path):
    proc, data, md = bench(tmp_path, "--layouts", "scanned", "--rows", "2", "--chunk", "8", "--max-context", "64")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rec,) = data["records"]
    assert rec["status"] == "ok"
    assert (rec["part"], rec["what"], rec["layout"], rec["n_layers"], rec["kernels"]) == (
        "compile", "decode", "scanned", 2, "reference")
    for key in ("backend", "device_kind", "jax_version", "commit", "seconds", "lower_s", "compile_s", "cpu_s"):
        assert rec[key] is not None, key
    assert rec["seconds"] == pytest.approx(rec["lower_s"] + rec["compile_s"])
    assert "## decode" in md and "| 2 |" in md
    assert "compile decode scanned 2" in proc.stderr  # progress


@pytest.mark.parametrize("args, error", [(("--layouts", "sideways"), "ValueError"),
                                         (("--layouts", "scanned", "--deadline-s", "0"), "deadline")])
def test_failures_are_error_records(tmp_path, args, error):
    proc, data, md = bench(tmp_path, *args)
    assert proc.returncode == 1
    (rec,) = data["records"]
    assert rec["status"] == "error" and error in rec["error"]
    assert "## Errors" in md
