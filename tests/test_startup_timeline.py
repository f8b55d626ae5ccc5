"""scripts/startup_timeline.py: a command's timeline in a fresh process (the events it records, the record it
writes, the summary it renders), on `ds4jax --version` (no compile, so seconds)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "startup_timeline.py")


def test_a_command_s_timeline_is_recorded_and_rendered(tmp_path):
    out = tmp_path / "t.json"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, SCRIPT, "--label", "version", "--out", str(out), "--", "--version"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ds4jax ")  # the command's own output passes through
    record = json.loads(out.read_text())
    kinds = [e["kind"] for e in record["events"]]
    assert kinds[:2] == ["import_jax", "imported"] and kinds[-1] == "end" and "first_byte" in kinds, kinds
    times = [e["t"] for e in record["events"]]
    assert times == sorted(times) and record["argv"] == ["--version"]
    table = subprocess.run([sys.executable, SCRIPT, "--render", str(out)], capture_output=True, text=True,
                           env=env, timeout=60).stdout
    assert "| version | --version |" in table, table
