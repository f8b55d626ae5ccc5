"""scripts/bench_mesh.py --smoke: the two-device benchmark end to end on 2 forced host CPU devices (subprocess)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_bench_mesh_smoke(tmp_path):
    out = tmp_path / "mesh.md"
    # the script forces its own 2 devices; the suite's other XLA flags (the cheap compile settings) stay
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = {**os.environ, "XLA_FLAGS": " ".join(flags)}
    script = os.path.join(ROOT, "scripts", "bench_mesh.py")
    proc = subprocess.run([sys.executable, script, "--smoke", "--out", str(out)], capture_output=True, text=True,
                          env=env, timeout=1200, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in open(tmp_path / "mesh.jsonl")]
    layouts = {r["layout"] for r in records}
    assert layouts == {"1 device", "EP 2", "DP 2 x EP"}, layouts
    assert {r["kind"] for r in records} == {"decode", "prefill"}
    for r in records:  # the sharded logits were checked against one device in the same run
        assert r["rel_err"] <= 1e-5 and r["tokens_per_s"] > 0 and r["memory"] > 0, r
    text = out.read_text()
    assert "| EP 2 | decode |" in text and (tmp_path / "mesh_scaling.png").exists()
