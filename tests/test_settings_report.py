"""scripts/command_buffers_report.py: one table from bench_engine runs that differ in one setting, and a failing
exit when a run is missing or failed its own token check (a benchmark that can fail)."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import command_buffers_report as report  # noqa: E402


def _run(root, folder, tokens_per_s, passed=True):
    runs = [{"batch": 1, "mode": "plain", "tokens_per_s": tokens_per_s, "mean_accepted": None, "errors": 0},
            {"batch": 1, "mode": "3", "tokens_per_s": 2 * tokens_per_s, "equal_to_plain": passed,
             "mean_accepted": 2.5, "errors": 0}]
    os.makedirs(root / folder)
    (root / folder / "engine.json").write_text(json.dumps({
        "device": "cpu:0", "jax": "0.x", "passed": passed, "steps_per_call": 16, "repeats": 3,
        "models": {"default": {"warmup_s": 5.0, "dtype": "float32", "prompt_len": 64, "new_tokens": 64,
                               "runs": runs}}}))


def test_greedy_branch_ratios_against_off(tmp_path):
    _run(tmp_path, "off", 100.0)
    _run(tmp_path, "on", 150.0)
    out = str(tmp_path / "greedy")
    assert report.main([str(tmp_path), "--compare", "greedy_branch", "--out", out]) == 0
    md = open(out + ".md").read()
    assert "| b1 plain | b1 k=3 |" in md and "150 (1.50x)" in md and "300 (1.50x)" in md and "PASS" in md


def test_a_failed_or_missing_run_fails_the_report(tmp_path):
    _run(tmp_path, "off", 100.0)
    out = str(tmp_path / "greedy")
    assert report.main([str(tmp_path), "--compare", "greedy_branch", "--out", out]) == 1  # no "on" run
    _run(tmp_path, "on", 150.0, passed=False)
    assert report.main([str(tmp_path), "--compare", "greedy_branch", "--out", out]) == 1
    assert "FAIL" in open(out + ".md").read()
