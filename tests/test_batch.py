"""`ds4jax batch`: killed halfway (SIGKILL) and rerun, every id is written exactly once; bad lines and failing
requests become error results with their line numbers; nothing finished is lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import cheap_compile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _lines(path):
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(x) for x in f.read().splitlines() if x.strip()]


def test_batch_killed_and_resumed(tmp_path):
    src = tmp_path / "in.jsonl"
    out = tmp_path / "out.jsonl"
    rows = [json.dumps({"id": "first", "prompt": "a", "max_new_tokens": 2}),
            "{not json",
            json.dumps({"id": "no-prompt"}),
            json.dumps({"id": "too-long", "prompt": "b", "max_new_tokens": 10_000}),
            json.dumps({"id": "bad-field", "prompt": "c", "colour": "red"}),
            json.dumps({"id": 7, "prompt": [5, 6, 7], "max_new_tokens": 3, "seed": 1, "temperature": 0.5})]
    # long requests after the first: the kill lands while they run (one slot, one token per host call). 4 x 60
    # decode calls (~12 ms of CPU each) outlast the 20 ms poll by far; the rerun then runs them all (4 x 200 were
    # 10 of the test's 33 CPU s)
    rows += [json.dumps({"id": f"long{i}", "prompt": f"prompt {i}", "max_new_tokens": 60}) for i in range(4)]
    rows.append(json.dumps({"id": "first", "prompt": "duplicate"}))
    src.write_text("\n".join(rows) + "\n")
    # XLA_FLAGS: the suite's (conftest: the cheap compile flags and 4 host devices), as every process the suite
    # starts: the device count is part of each program's key in the run's compilation cache
    env = dict(os.environ, JAX_PLATFORMS="cpu", DS4JAX_COMPILATION_CACHE=str(tmp_path / "cache"),
               XLA_FLAGS=os.environ.get("XLA_FLAGS") or cheap_compile.xla_flags(devices=4), PYTHONPATH=ROOT)
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "batch_generate.py"), str(src), str(out), "--max-slots", "1",
           "--max-context", "256", "--steps-per-call", "1", "--prefill-chunk", "16", "--no-progress"]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if any(r["finish_reason"] != "error" for r in _lines(out)):
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = _lines(out)
    generated = [r for r in first if r["finish_reason"] != "error"]
    assert generated, proc.stdout.read().decode()[-3000:]
    assert len(first) < len(rows), "the run finished before the kill: nothing was tested"

    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    final = _lines(out)
    keys = [r["key"] for r in final]
    assert len(keys) == len(set(keys)) == len(rows)  # every line exactly once, the first run's results kept
    assert final[: len(first)] == first
    by_id = {r["id"]: r for r in final if r["id"] is not None and not r["key"].startswith("line:")}
    assert by_id["first"]["finish_reason"] in ("length", "stop") and by_id["first"]["error"] is None
    assert by_id[7]["error"] is None and len(by_id[7]["tokens"]) <= 3
    assert all(by_id[f"long{i}"]["error"] is None for i in range(4))
    errors = {r["line"]: r for r in final if r["error"]}
    assert errors[2]["error"] == "invalid_request" and "line 2: invalid JSON" in errors[2]["message"]
    assert errors[3]["error"] == "invalid_request" and "'prompt'" in errors[3]["message"]
    assert errors[4]["error"] == "prompt_too_long" and "line 4" in errors[4]["message"]
    assert errors[5]["error"] == "invalid_request" and "colour" in errors[5]["message"]
    assert errors[11]["error"] == "invalid_request" and "duplicate id" in errors[11]["message"]
