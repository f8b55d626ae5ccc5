"""scripts/pytest_compile_profile.py's summary: the workers' files merged, tests by wall time, programs by XLA time."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import pytest_compile_profile as profile


def _record(wall, xla, programs):
    return {"wall": wall, "cpu": wall, "events": {"backend_compile_duration": xla}, "programs": programs}


def test_summary_merges_workers_and_orders_by_cost(tmp_path):
    (tmp_path / "gw0.json").write_text(json.dumps({"t::fast": _record(1.0, 0.5, {"jit(decode_loop)": [1, 0.5]})}))
    (tmp_path / "gw1.json").write_text(json.dumps({"t::slow": _record(9.0, 7.0, {"jit(decode_loop)": [2, 3.0],
                                                                              "jit(prefill_call)": [1, 4.0]})}))
    lines = profile.summary(str(tmp_path)).splitlines()
    tests = [line.rsplit("| ", 1)[-1] for line in lines[1:3]]
    assert tests == ["t::slow", "t::fast"]
    programs = lines[lines.index("XLA s | compiles | program") + 1:]
    assert programs[0].endswith("jit(prefill_call)")  # 4.0 s, ahead of decode's 3.5 s over both workers
    decode = next(p for p in programs if p.endswith("jit(decode_loop)"))
    assert decode.split("|")[1].strip() == "3" and decode.startswith("  3.5")  # both workers' compiles summed


def test_the_controllers_empty_records_do_not_replace_the_workers(tmp_path):
    """Under xdist the controller (main.json) logs every test with no time of its own; glob order must not matter."""
    (tmp_path / "gw0.json").write_text(json.dumps({"t::slow": _record(9.0, 7.0, {"jit(decode_loop)": [1, 7.0]})}))
    (tmp_path / "main.json").write_text(json.dumps({"t::slow": _record(0.0, 0.0, {})}))
    line = profile.summary(str(tmp_path)).splitlines()[1]
    assert line.startswith("   9.0 |") and line.endswith("t::slow"), line


def test_totals_sum_every_worker(tmp_path):
    """The two lines .ci/run prints: the test processes' sums and the programs by XLA seconds."""
    slow = dict(_record(9.0, 7.0, {"jit(decode_loop)": [2, 3.0], "jit(prefill_call)": [1, 4.0]}))
    slow["events"]["jaxpr_trace_duration"] = 1.5
    (tmp_path / "gw0.json").write_text(json.dumps({"t::fast": _record(1.0, 0.5, {"jit(decode_loop)": [1, 0.5]})}))
    (tmp_path / "gw1.json").write_text(json.dumps({"t::slow": slow}))
    (tmp_path / "main.json").write_text(json.dumps({"t::slow": _record(0.0, 0.0, {})}))
    sums, programs = profile.totals(str(tmp_path)).splitlines()
    assert "tests' wall 10 s" in sums and "XLA compile 8 s" in sums and "tracing 2 s" in sums, sums
    assert programs.index("jit(prefill_call) 4 s / 1") < programs.index("jit(decode_loop) 4 s / 3"), programs
