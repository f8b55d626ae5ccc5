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


def _kv_res(kv_cos):
    res = _res(0.9999)
    res["modes"][bq.KV_MODE] = {"decode": {"ms": 0.5, "bytes": 1e9, "roofline_ms": 0.2, "fraction_of_roofline": 0.4}}
    if kv_cos is not None:
        check = {"finite": bool(np.isfinite(kv_cos)), "cosine": kv_cos, "rel_err": 0.01, "argmax_equal": True}
        res["checks"]["decode"].update(fp8_kv_vs_fp8_fp4=check, fp8_kv_vs_bf16=check)
    return res


def test_fp8_kv_failures_and_markdown(tmp_path):
    """--fp8-kv: the KV-only check (same weights, bf16 vs FP8 cache) must pass, and the table gets the column."""
    assert bq.failures(_kv_res(0.999)) == []
    assert "FP8 KV" in bq.failures(_kv_res(0.5))[0]
    assert "no FP8 KV check logits" in bq.failures(_kv_res(None))[0]
    res = _kv_res(0.999)
    for mode in res["modes"].values():
        for r in mode.values():
            r.setdefault("bytes", 1e9), r.setdefault("roofline_ms", 0.5), r.setdefault("fraction_of_roofline", 0.5)
    res["checks"]["decode"]["fp8_fp4_vs_dequantized"].update(rel_err=0.0)
    res.update(layers=4, device="gpu", jax="0", kernels="pallas", copy_bandwidth_tb_s=4.0, matmul_tflop_s=700.0,
               weight_gb={"bf16": 1.0, "fp8_fp4": 0.5}, failures=[])
    bq.write_markdown(res, str(tmp_path / "q.md"))
    text = (tmp_path / "q.md").read_text()
    assert "| decode | fp8_fp4 + FP8 KV | 0.500 |" in text and "+ FP8 KV vs fp8_fp4" in text
    assert bq.parse(["--fp8-kv", "--cases", "decode_b1_ctx2048"]).fp8_kv


def test_profile_table_in_markdown(tmp_path):
    """--profile: each traced decode case and format gets a row (busy, kernels per step, heaviest kernels)."""
    res = _kv_res(0.999)
    prof = {"device_busy_ms_per_step": 1.25, "kernels_per_step": 301.0,
            "top_kernels_us_per_step": {"fp8_matmul_kernel": 310.5, "grouped_matmul_fp4": 120.0}}
    for mode in res["modes"].values():
        for r in mode.values():
            r.setdefault("bytes", 1e9), r.setdefault("roofline_ms", 0.5), r.setdefault("fraction_of_roofline", 0.5)
    res["modes"]["fp8_fp4"]["decode"]["profile"] = prof
    res["checks"]["decode"]["fp8_fp4_vs_dequantized"].update(rel_err=0.0)
    res.update(layers=4, device="gpu", jax="0", kernels="pallas", copy_bandwidth_tb_s=4.0, matmul_tflop_s=700.0,
               weight_gb={"bf16": 1.0, "fp8_fp4": 0.5}, failures=[])
    bq.write_markdown(res, str(tmp_path / "q.md"))
    text = (tmp_path / "q.md").read_text()
    assert "| decode | fp8_fp4 | 1.250 | 301 | `fp8_matmul_kernel` 310.5, `grouped_matmul_fp4` 120.0 |" in text
    assert bq.parse(["--profile"]).profile


def test_quantized_only_failures():
    """--quantized-only fails on an errored case, a missing or broken per-layer check, and the per-layer check's
    own failures (a layer or the logits below the cosine, or non-finite: `layer_check.check_layers` lists them)."""
    def res(failures=(), error=None, check=True, check_error=None):
        case = {"error": error} if error else {"ms": 1.0}
        c = {"error": check_error} if check_error else {"layers": [], "worst": 0.9999, "failures": list(failures)}
        checks = {"decode": {bq.LAYER_CHECK: c}}
        return {"modes": {"fp8_fp4": {"decode": case}}, "checks": checks if check else {}}

    assert bq.quantized_only_failures(res()) == []
    assert "layer 3: cosine" in bq.quantized_only_failures(res(["layer 3: cosine 0.5000 < 0.99 or non-finite"]))[0]
    assert "no per-layer check" in bq.quantized_only_failures(res(check=False))[0]
    assert "OOM" in bq.quantized_only_failures(res(check_error="RuntimeError: OOM"))[0]
    assert "boom" in bq.quantized_only_failures(res(error="RuntimeError: boom"))[0]


def test_a_failed_8_a_call_timing_fails_the_run():
    res = _res(0.9999)
    res["modes"]["fp8_fp4"]["decode"]["loop_error"] = "RuntimeError: out of memory"
    assert any("8 a call" in f for f in bq.failures(res))


def test_projection_reads_each_devices_share_at_the_measured_bandwidth():
    """On one GPU the projection of the measured model is the measurement; splitting the experts over more GPUs
    removes their share of the touched experts' bytes, nothing else."""
    import ds4jax

    cfg = ds4jax.tiny()
    pb = bq.full_model_bytes(cfg)
    need = bq.common.decode_bytes(cfg, pb, 8, 64)
    measured = {"decode_b8_ctx64": {"bytes": need, "ms": 2.0, "ms_per_step_loop": 1.0, "rows": 8, "ctx": 64},
                "prefill_b1_s64": {"ms": 5.0}}
    rows = bq.projection(measured, cfg, pb, eps=(1, 2, 8))
    assert [r["gpus"] for r in rows] == [1, 2, 8] and all(r["case"] == "decode_b8_ctx64" for r in rows)
    assert abs(rows[0]["projected_ms_per_step"] - 1.0) < 1e-12  # the 8-a-call time, not one a call
    touched = pb["per_expert"] * min(cfg.num_routed_experts, 8 * cfg.num_experts_per_tok)
    for r in rows[1:]:
        assert abs(r["bytes_per_device"] - (need - touched * (1 - 1 / r["gpus"]))) < 1e-6
        assert r["projected_ms_per_step"] < 1.0
