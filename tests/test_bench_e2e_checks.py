"""scripts/bench_e2e.py can fail: its row-wise self-check rejects wrong or non-finite logits, and `failures` turns a
failed check, a missing check or a failed case into reasons that make the script exit non-zero (no timing runs)."""

import os
import sys

import numpy as np

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
sys.path.insert(0, SCRIPTS)

import bench_e2e  # noqa: E402
import e2e_ds4jax  # noqa: E402


def _logits(rows=8, vocab=64, seed=0):
    return np.random.default_rng(seed).normal(size=(rows, vocab)).astype(np.float32)


def test_agreement_passes_close_rows_and_fails_one_wrong_row():
    ref = _logits()
    close = ref + 1e-3 * _logits(seed=1)
    assert e2e_ds4jax.agreement(close, ref)["pass"]
    wrong = close.copy()
    wrong[5] = _logits(rows=1, seed=2)[0]  # one unrelated row among eight
    check = e2e_ds4jax.agreement(wrong, ref)
    assert not check["pass"] and check["rows"] == 8 and check["argmax_equal_rows"] < 8


def test_agreement_fails_non_finite_logits():
    ref = _logits()
    bad = ref.copy()
    bad[3, 7] = np.nan
    check = e2e_ds4jax.agreement(bad, ref)
    assert not check["pass"] and not check["finite"]


def _result(**case):
    return {"kernels": "pallas", "sides": {"ds4jax": {}}, "check": {"min_cosine": 0.99},
            "cases": {"decode_b8_ctx2048": {"ms_per_step": 1.0, **case}}}


def test_failures_name_each_reason():
    ok = {"pass": True, "rows": 8, "min_cosine": 0.9999, "finite": True}
    assert bench_e2e.failures(_result(self_check=ok)) == []
    assert "self-check failed" in bench_e2e.failures(_result(self_check={**ok, "pass": False}))[0]
    assert "no self-check" in bench_e2e.failures(_result())[0]
    res = _result(self_check=ok)
    res["check"]["prefill_after"] = {"cosine": 0.2, "pass": False}
    res["cases"]["prefill_b1_s2048"] = {"error": "RuntimeError: boom"}
    res["sides"]["hf"] = {"error": "side hf exited with status 1"}
    reasons = bench_e2e.failures(res)
    assert len(reasons) == 3 and any("HF check" in r for r in reasons) and any("boom" in r for r in reasons)


def test_bandwidth_note_never_calls_a_host_figure_device_timed():
    import e2e_common

    note = e2e_common.bandwidth_note
    assert note({"copy_bandwidth_device_timed_tb_s": 4.3, "copy_bandwidth_host_timed_tb_s": 3.65}).startswith(
        "4.30 TB/s (device-timed")
    failed = note({"copy_bandwidth_device_timed_tb_s": None, "copy_bandwidth_host_timed_tb_s": 2.89,
                   "copy_bandwidth_device_timed_error": "RuntimeError: no device events"})
    assert failed.startswith("2.89 TB/s (host-timed") and "no device events" in failed and "device-timed:" not in failed
    assert note({"copy_bandwidth_tb_s": 3.0}) == "3.00 TB/s (timing not recorded)"  # results from before both
