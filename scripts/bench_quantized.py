"""FP8 dense + FP4 experts vs bf16 on the device: decode and prefill of `flash_slice(n)` (issue 26).

One process, seeded random weights (`P.init(cfg, key(0), bf16)`, as `bench_e2e.py`):

1. ``bf16``: the bf16 model; prefill 2048 tokens (b=1) and greedy decode at b=1 and b=8 after 2048-token prompts;
2. ``fp8_fp4``: the same weights quantized on the device as a published instruct checkpoint
   (`ds4jax.model.quantize.quantize_model`: FP8 E4M3 + 128x128 E8M0 block scales for the dense linears, FP4
   experts; the bf16 copy is dropped first), the same cases; routed experts through `grouped_matmul_fp4`;
3. ``dequantized``: the quantized values dequantized to bf16 (the bf16 programs, same weights as 2): the
   correctness check. Quantized vs dequantized logits (prefill last token, first decode step with a fixed token)
   must agree to bf16 rounding (cosine >= 0.99, finite), else the exit status is 1. Quantized vs the original
   bf16 is the quantization error, reported (on random weights FP4 is coarse: not a pass/fail criterion).

4. ``fp8_fp4_kv8`` (with ``--fp8-kv``): the quantized model of 2 with the FP8 KV cache (`kv_dtype="fp8"`: E4M3
   pools + one f32 scale per row, read by the Pallas kernels as stored), decode cases only: the "+ FP8 KV" column.
   Its check logits against 2 (same weights: the KV quantization alone) must have cosine >= MIN_KV_COSINE and be
   finite; against bf16 it is reported.

Per case: ms (per step for decode), bytes a step must read in that format, the roofline (bytes / device-timed
copy bandwidth; prefill: max of weight reads and FLOPs at the measured matmul rate) and the fraction of it.

    PYTHONPATH=. python scripts/bench_quantized.py [--layers 4] [--out $OUT/quant] [--smoke] [--fp8-kv]
        [--cases decode_b1_ctx2048,decode_b8_ctx2048]

Writes OUT/quantized.json (rewritten as results arrive) and OUT/quantized.md. --smoke: tiny config, short
sequences, interpreted kernels (a CPU check of the script).

--quantized-only: the FP8 + FP4 model alone, drawn leaf by leaf (slices too large for a bf16 copy), written to
OUT/quantized_only.{json,md} with a projection to the whole model. Its check is per layer (`layer_check.py`): each
layer's update and the head's logits against the reference kernels on the same input, since the whole model's
logits drift apart with depth on random weights (cosine 0.97 at 16 layers, docs/benchmarks/scan_in_place/).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ds4jax  # noqa: E402
import e2e_common as common  # noqa: E402
from e2e_common import compare  # noqa: E402
import device_trace  # noqa: E402
import layer_check  # noqa: E402
from e2e_ds4jax import Bench, copy_bandwidth, looped_timing, matmul_flops  # noqa: E402
from ds4jax.model import layer_stack  # noqa: E402
from ds4jax.model import params as P  # noqa: E402
from ds4jax.model.handle import Model  # noqa: E402
from ds4jax.model.quantize import abstract_quantized, quantize_model, random_quantized_model  # noqa: E402
from ds4jax.model.quantized import is_quantized  # noqa: E402
from ds4jax.runtime import steps  # noqa: E402
from ds4jax.runtime.target import device_target  # noqa: E402

MIN_COSINE = 0.99  # quantized path vs the same values in bf16: only rounding order differs
# FP8 KV vs the same weights with a bf16 cache: E4M3 keeps 3 mantissa bits of every cached value; a wrong scale or
# an FNUZ/OCP mix-up (a factor of 2 on every key) falls far below this
MIN_KV_COSINE = 0.98
KV_MODE = "fp8_fp4_kv8"
CHECK_TOKEN = 7  # the decode check feeds this token to every row (same input whatever the modes' prefill argmax)
LAYER_CHECK = "per_layer_vs_reference_kernels"  # --quantized-only's check (layer_check.py)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", default=os.path.join(os.environ["OUT"], "quant") if os.environ.get("OUT")
                    else "docs/benchmarks")
    ap.add_argument("--kernels", default=None, choices=["pallas", "reference", "pallas_interpret"],
                    help="default: pallas on a GPU, pallas_interpret with --smoke")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--fp8-kv", action="store_true",
                    help=f"also run the quantized model with the FP8 KV cache (mode {KV_MODE}, decode cases)")
    ap.add_argument("--cases", default=None, help="comma-separated case names to run (default: all)")
    ap.add_argument("--profile", action="store_true",
                    help="a device trace per case and mode (kernels per step, device busy, heaviest kernels; a "
                         "prefill counts as one step)")
    ap.add_argument("--quantized-only", action="store_true",
                    help="only the FP8 + FP4 model, built leaf by leaf (random_quantized_model: no bf16 copy, for "
                         "slices too large in bf16, e.g. --layers 28 on an H200), checked layer by layer against "
                         "the reference kernels on the same weights (scripts/layer_check.py: the whole model's "
                         "logits drift apart with depth on random weights); writes quantized_only.{json,md}")
    ap.add_argument("--render-only", metavar="JSON",
                    help="only write the markdown of this JSON into --out (a run cut short is rendered as failed)")
    return ap.parse_args(argv)


def cases(smoke: bool) -> list[common.Case]:
    s = 32 if smoke else 1
    return [common.Case("prefill_b1_s2048", "prefill", 1, 2048 // s, 2048 // s),
            common.Case("decode_b1_ctx2048", "decode", 1, 2048 // s, new=32 // (s // 8 or 1)),
            common.Case("decode_b8_ctx2048", "decode", 8, 2048 // s, new=32 // (s // 8 or 1))]


def check_logits(bench: Bench, case: common.Case) -> np.ndarray:
    """Logits that do not depend on the mode's own greedy choices: prefill's last token (all rows), or one decode
    step feeding CHECK_TOKEN after the prefill (the timed decode program)."""
    logits, pool = bench.prefill(case.rows, case.size, min(case.size, case.chunk))()
    if case.kind == "prefill":
        return np.asarray(logits, np.float32)
    rows = case.rows
    batch = steps.StepBatch(jnp.arange(rows, dtype=jnp.int32), jnp.full((rows, 1), CHECK_TOKEN, jnp.int32),
                            jnp.ones((rows,), jnp.int32))
    out, _ = steps.decode(bench.model.params, pool, batch, cfg=bench.model.config, spec=bench.spec,
                          kernels=bench.kernels)
    return np.asarray(out.logits, np.float32)


def run_mode(model: Model, kernels: str, smoke: bool, bw: float, peak: float, timed: bool = True,
             only: tuple[str, ...] | None = None, kv_dtype: str = "auto", profile: bool = False,
             with_logits: bool = True) -> tuple[dict, dict]:
    """(per case results, per case check logits) for one weight format (and KV cache dtype); `only`: case names;
    `with_logits` False: no check logits (the caller checks otherwise)."""
    cfg = model.config
    bench = Bench(model, kernels, max_context=2048 + 512, max_slots=8)
    bench.spec = bench.spec.replace(kv_dtype=kv_dtype)
    kv_bytes = dict(kv_itemsize=1, kv_row_bytes=4) if bench.spec.kv_scaled else {}
    pb, active = common.param_bytes(cfg, model.params), common.active_params(cfg, model.params)
    results, logits = {}, {}
    for case in cases(smoke):
        if only is not None and case.name not in only:
            continue
        try:
            t = time.perf_counter()
            if with_logits:
                logits[case.name] = check_logits(bench, case)
            r = {"check_compile_s": time.perf_counter() - t} if with_logits else {}
            if timed and case.kind == "prefill":
                fn = bench.prefill(case.rows, case.size, case.chunk)
                jax.block_until_ready(fn()[0])
                secs = statistics.median(common.timed(fn, 3))
                nbytes, flops = common.prefill_cost(cfg, pb, active, case.rows, case.size)
                floor = max(nbytes / bw, flops / peak)
                r.update(ms=secs * 1e3, tokens_per_s=case.rows * case.size / secs, bytes=nbytes, flops=flops,
                         roofline_ms=floor * 1e3, roofline_bound="weights" if nbytes / bw >= flops / peak else "flops",
                         fraction_of_roofline=floor / secs)
                if profile:  # which kernels hold a prefill's time (the whole prefill counted as one step)
                    r["profile"] = device_trace.profile(lambda: jax.block_until_ready(fn()[0]), 1, cfg.num_layers)
            elif timed:
                fn, _, _ = bench.decode(case.rows, case.size, case.new)
                fn()
                secs = statistics.median(common.timed(fn, 3)) / case.new
                need = common.decode_bytes(cfg, pb, case.rows, case.size, **kv_bytes)
                r.update(ms=secs * 1e3, ms_per_step=secs * 1e3, tokens_per_s=case.rows / secs, bytes=need,
                         roofline_ms=need / bw * 1e3, fraction_of_roofline=need / bw / secs, rows=case.rows,
                         ctx=case.size)
                # and as the engine decodes: 8 steps a call (one a call, a batch-1 step is bound by the dispatch)
                r.update(looped_timing(bench, case, need, bw))
                if profile:  # where a step's device time goes (the heaviest kernels), from a trace of one run
                    r["profile"] = device_trace.profile(lambda: common.timed(fn, 1), case.new,
                                                        cfg.num_layers)
                del fn
        except Exception as e:  # recorded; the other cases still run, and the run fails
            r = {"error": f"{type(e).__name__}: {e}"[:1500], "trace": traceback.format_exc()[-2500:]}
        results[case.name] = r
        print(case.name, json.dumps(r)[:300], flush=True)
        gc.collect()
    return results, logits


def dequantized(model: Model) -> Model:
    """The quantized values in bf16, on the device, leaf by leaf (`QuantizedWeight.dequantize`)."""
    deq = jax.jit(lambda w: w.dequantize(jnp.bfloat16))
    params = jax.tree.map(lambda w: deq(w) if is_quantized(w) else w, model.params, is_leaf=is_quantized)
    return Model(model.config, params)


def check_failure(name: str, c: dict | None, what: str) -> list[str]:
    """[] when comparison `c` is finite with cosine >= MIN_COSINE, else the reason (a missing one included)."""
    if c is None:
        return [f"{name}: no check logits"]
    if not c["finite"] or not c["cosine"] >= MIN_COSINE:
        return [f"{name}: {what} cosine {c['cosine']:.4f} < {MIN_COSINE} or non-finite"]
    return []


def case_errors(mode: str, by_case: dict) -> list[str]:
    """A mode's failed cases: the case itself, or its 8-steps-a-call timing."""
    return ([f"{mode} {name}: {r['error'][:200]}" for name, r in by_case.items() if "error" in r]
            + [f"{mode} {name} (8 a call): {r['loop_error'][:200]}" for name, r in by_case.items()
               if "loop_error" in r])


def failures(res: dict) -> list[str]:
    out = []
    for mode, by_case in res["modes"].items():
        out += case_errors(mode, by_case)
    for name, c in res["checks"].items():
        out += check_failure(name, c.get("fp8_fp4_vs_dequantized"), "quantized vs dequantized")
        kv = c.get("fp8_kv_vs_fp8_fp4")
        if KV_MODE in res["modes"] and name in res["modes"][KV_MODE] and kv is None:
            out.append(f"{name}: no FP8 KV check logits")
        elif kv is not None and (not kv["finite"] or not kv["cosine"] >= MIN_KV_COSINE):
            out.append(f"{name}: FP8 KV vs bf16 KV (same weights) cosine {kv['cosine']:.4f} < {MIN_KV_COSINE} or "
                       "non-finite")
    return out


def run_line(res: dict) -> str:
    return f"{res['device']}, jax {res['jax']}, kernels {res['kernels']}; copy bandwidth {common.bandwidth_note(res)}"


def _looped_cell(r: dict) -> str:
    """A decode case's 8-steps-a-call figure (blank for prefill; the error, shortened, when it failed)."""
    if "ms_per_step_loop" in r:
        return f"{r['ms_per_step_loop']:.3f} ({100 * r['fraction_of_roofline_loop']:.0f} %)"
    return f"error: {r['loop_error'][:80]}" if "loop_error" in r else ""


def write_markdown(res: dict, path: str) -> None:
    # a JSON without "failures" is a run stopped before its checks (time limit, crash): never rendered as a pass
    fails = res["failures"] if "failures" in res else failures(res) + ["the run stopped before it finished"]
    lines = [f"# FP8 dense + FP4 experts vs bf16: `flash_slice({res['layers']})`", "",
             f"{run_line(res)}, bf16 matmul {res['matmul_tflop_s'] or 0:.0f} "
             f"TFLOP/s. Weights: bf16 {res['weight_gb']['bf16']:.2f} GB, FP8 + FP4 {res['weight_gb']['fp8_fp4']:.2f} "
             "GB. Written by `scripts/bench_quantized.py`.", "",
             "ms (per step): one step a call; 8 a call: as the engine decodes (8 steps in one compiled call, "
             "`e2e_ds4jax.looped_timing`), where a batch-1 step is not bound by the host's dispatch.", "",
             "| case | format | ms (per step) | bytes read | roofline ms | fraction | speedup vs bf16 | ms, 8 a call "
             "(fraction) |",
             "|---|---|---|---|---|---|---|---|"]
    for name in res["modes"]["bf16"]:
        base = res["modes"]["bf16"][name].get("ms")
        for mode in [m for m in ("bf16", "fp8_fp4", KV_MODE) if m in res["modes"]]:
            r = res["modes"][mode].get(name, {})
            if mode == KV_MODE and not r:  # decode cases only
                continue
            mode = "fp8_fp4 + FP8 KV" if mode == KV_MODE else mode
            if "ms" not in r:
                lines.append(f"| {name} | {mode} | error | | | | | |")
                continue
            speed = f"{base / r['ms']:.2f}x" if base else ""
            lines.append(f"| {name} | {mode} | {r['ms']:.3f} | {r['bytes'] / 1e9:.3f} GB | {r['roofline_ms']:.3f} | "
                         f"{100 * r['fraction_of_roofline']:.0f} % | {speed} | {_looped_cell(r)} |")
    lines += ["", "Logits (prefill: last token of every row; decode: one step feeding a fixed token after the "
              "prefill):", "",
              "| case | quantized vs dequantized (cosine, rel err) | quantized vs bf16 (cosine, rel err, argmax equal) |",
              "|---|---|---|"]
    for name, c in res["checks"].items():
        q, b = c.get("fp8_fp4_vs_dequantized") or {}, c.get("fp8_fp4_vs_bf16") or {}
        lines.append(f"| {name} | {q.get('cosine', float('nan')):.5f}, {q.get('rel_err', float('nan')):.2e} | "
                     f"{b.get('cosine', float('nan')):.4f}, {b.get('rel_err', float('nan')):.2e}, "
                     f"{b.get('argmax_equal')} |")
    kv_rows = [(name, c) for name, c in res["checks"].items() if "fp8_kv_vs_fp8_fp4" in c]
    if kv_rows:
        lines += ["", "FP8 KV cache (decode check logits):", "",
                  "| case | + FP8 KV vs fp8_fp4 (cosine, rel err, argmax equal) | + FP8 KV vs bf16 (cosine, rel err) |",
                  "|---|---|---|"]
        for name, c in kv_rows:
            a, b = c["fp8_kv_vs_fp8_fp4"], c.get("fp8_kv_vs_bf16") or {}
            lines.append(f"| {name} | {a['cosine']:.5f}, {a['rel_err']:.2e}, {a['argmax_equal']} | "
                         f"{b.get('cosine', float('nan')):.4f}, {b.get('rel_err', float('nan')):.2e} |")
    profiled = [(name, mode, r["profile"]) for mode, by_case in res["modes"].items()
                for name, r in by_case.items() if r.get("profile")]
    if profiled:
        lines += ["", "Steps traced (`--profile`, one run each; a prefill is one step): device busy and kernels per "
                  "step, and the five heaviest kernels (us per step):", "",
                  "| case | format | busy ms / step | kernels / step | heaviest |",
                  "|---|---|---|---|---|"]
        for name, mode, prof in profiled:
            top = ", ".join(f"`{k[:48]}` {v}" for k, v in list(prof["top_kernels_us_per_step"].items())[:5])
            lines.append(f"| {name} | {mode} | {prof['device_busy_ms_per_step']:.3f} | "
                         f"{prof['kernels_per_step']:.0f} | {top} |")
    lines += ["", f"Check: quantized vs dequantized cosine >= {MIN_COSINE}"
              + (f", FP8 KV vs bf16 KV cosine >= {MIN_KV_COSINE}" if kv_rows else "") + ": "
              + ("PASS" if not fails else "FAIL: " + "; ".join(fails)), ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def quantized_only_failures(res: dict) -> list[str]:
    """The cases' errors and each case's per-layer check (`layer_check`: every layer and the logits, cosine >=
    MIN_COSINE against the reference kernels on the same input), a missing or broken check included."""
    out = case_errors("fp8_fp4", res["modes"]["fp8_fp4"])
    for name in res["modes"]["fp8_fp4"]:
        c = res["checks"].get(name, {}).get(LAYER_CHECK)
        if c is None:
            out.append(f"{name}: no per-layer check")
        elif "error" in c:
            out.append(f"{name}: per-layer check: {c['error'][:200]}")
        else:
            out += [f"{name}: {f}" for f in c["failures"]]
    return out


def layer_checks(model: Model, kernels: str, smoke: bool, only: tuple[str, ...] | None, save=None) -> dict:
    """Per case: `layer_check.check_layers` of its step (the decode step after its prompt, or its prefill's last
    chunk), the kernels against the reference kernels one layer at a time. Each layer is printed as it is done, and
    `save(checks)` is called after each case (a run cut short keeps the checks it finished)."""
    out = {}
    for case in cases(smoke):
        if only is not None and case.name not in only:
            continue
        t = time.perf_counter()
        try:
            c = layer_check.check_layers(
                model, kernels, rows=case.rows, ctx=case.size, chunk=min(case.size, case.chunk), token=CHECK_TOKEN,
                prompt=common.prompt_ids(case.rows, case.size, model.config.vocab_size), max_context=2048 + 512,
                decode=case.kind == "decode", min_cosine=MIN_COSINE,
                on_layer=lambda r, name=case.name: print(f"{name} layer {r['layer']} ({r['kind']}): cosine "
                                                         f"{r['cosine']:.5f}, {r['seconds']:.1f} s", flush=True))
        except Exception as e:  # recorded: the run fails
            c = {"error": f"{type(e).__name__}: {e}"[:1500], "trace": traceback.format_exc()[-2500:]}
        out[case.name] = {LAYER_CHECK: dict(c, seconds=time.perf_counter() - t)}
        print(case.name, "per-layer check", json.dumps({k: c.get(k) for k in ("worst", "failures", "error")}),
              flush=True)
        if save is not None:
            save(out)
        gc.collect()
    return out


def write_quantized_only_markdown(res: dict, path: str) -> None:
    fails = res["failures"] if "failures" in res else quantized_only_failures(res) + ["the run stopped early"]
    lines = [f"# FP8 dense + FP4 experts alone: `flash_slice({res['layers']})`", "",
             f"{run_line(res)}. Weights FP8 + FP4 {res['weight_gb']['fp8_fp4']:.2f} GB, built leaf by "
             "leaf (`random_quantized_model`, no bf16 copy). Written by `scripts/bench_quantized.py "
             "--quantized-only`.", "",
             "| case | ms (per step) | bytes read | roofline ms | fraction | ms, 8 a call (fraction) | per-layer "
             "check: lowest cosine (layers + logits) |", "|---|---|---|---|---|---|---|"]
    for name, r in res["modes"]["fp8_fp4"].items():
        c = res["checks"].get(name, {}).get(LAYER_CHECK) or {}
        check = "error" if "error" in c else (f"{c['worst']:.5f} ({len(c['layers'])} + 1)" if c else "-")
        if "ms" not in r:
            lines.append(f"| {name} | error | | | | | {check} |")
            continue
        lines.append(f"| {name} | {r['ms']:.3f} | {r['bytes'] / 1e9:.3f} GB | {r['roofline_ms']:.3f} | "
                     f"{100 * r['fraction_of_roofline']:.0f} % | {_looped_cell(r)} | {check} |")
    if res.get("projection"):
        lines += ["", f"Projected to the whole model ({res['projection'][0]['layers']} layers), experts split over the "
                  "GPUs (expert parallelism), each device reading the dense weights, the head, every row's KV and its "
                  "share of the experts the batch touches at the bandwidth this slice reached (its bytes / its ms, "
                  "8 steps a call); the per-layer all-reduce of the experts' outputs is not included:", "",
                  "| case | GPUs | bytes per device per step | projected ms per step | from: measured ms, bytes |",
                  "|---|---|---|---|---|"]
        for p in res["projection"]:
            lines.append(f"| {p['case']} | {p['gpus']} | {p['bytes_per_device'] / 1e9:.2f} GB | "
                         f"{p['projected_ms_per_step']:.3f} | {p['measured_ms_per_step']:.3f} ms, "
                         f"{p['measured_bytes'] / 1e9:.2f} GB |")
    lines += ["", f"Check (`scripts/layer_check.py`): each layer's update to the streams and the head's logits, the "
              "kernels against the reference kernels on the same inputs and weights (the reference path's own input "
              f"to each layer), cosine >= {MIN_COSINE}: " + ("PASS" if not fails else "FAIL: " + "; ".join(fails)), ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def quantized_only(args, res: dict, cfg, kernels: str, bw: float, peak: float) -> int:
    """--quantized-only: the published format alone (see `parse`), exit 1 when a case fails or disagrees."""
    json_path = os.path.join(args.out, "quantized_only.json")
    only = None if args.cases is None else tuple(args.cases.split(","))
    t0 = time.perf_counter()
    model = random_quantized_model(cfg, jax.random.key(common.SEED), "fp4", fp8_dtype=device_target().fp8_dtype)
    jax.block_until_ready(model.params)
    res["quantize_s"] = time.perf_counter() - t0
    res["weight_gb"]["fp8_fp4"] = sum(x.nbytes for x in jax.tree.leaves(model.params)) / 1e9
    res["modes"]["fp8_fp4"], _ = run_mode(model, kernels, args.smoke, bw, peak, only=only, profile=args.profile,
                                          with_logits=False)
    common.write_json(json_path, res)
    res["checks"] = layer_checks(model, kernels, args.smoke, only, save=lambda checks: common.write_json(
        json_path, dict(res, checks=checks)))
    full = cfg if args.smoke else ds4jax.flash_slice(ds4jax.flash().num_layers)  # the smoke projects itself
    res["projection"] = projection(res["modes"]["fp8_fp4"], full, full_model_bytes(full))
    return finish(res, t0, json_path, quantized_only_failures, write_quantized_only_markdown)


def full_model_bytes(full_cfg) -> dict:
    """`common.param_bytes` of `full_cfg` in the published format, from shapes alone (nothing allocated)."""
    shapes = abstract_quantized(full_cfg, P.abstract(full_cfg, jnp.bfloat16), "fp4")
    return common.param_bytes(full_cfg, jax.tree.map(lambda s: np.broadcast_to(np.zeros((), s.dtype), s.shape), shapes))


def projection(measured: dict, full_cfg, pb_full: dict, eps=(2, 8)) -> list[dict]:
    """Decode of `full_cfg` on `ep` GPUs (experts split over them, everything else on each), projected from the
    measured cases (`measured`: case -> result with `bytes` and the 8-a-call `ms_per_step_loop`, else one a call):
    each device reads the dense weights, the head, every row's KV and its share of the experts the batch touches,
    at the bandwidth the measured slice reached (bytes / ms). The expert-parallel all-reduce per layer is not
    included (not measured here)."""
    rows = []
    for name, r in measured.items():
        ms = r.get("ms_per_step_loop", r.get("ms"))
        if not name.startswith("decode") or ms is None:
            continue
        batch, ctx = r["rows"], r["ctx"]
        reached = r["bytes"] / (ms / 1e3)  # bytes per second the measured slice read
        total = common.decode_bytes(full_cfg, pb_full, batch, ctx)
        touched = pb_full["per_expert"] * min(full_cfg.num_routed_experts, batch * full_cfg.num_experts_per_tok)
        for ep in eps:
            per_device = total - touched * (1 - 1 / ep)
            rows.append({"case": name, "layers": full_cfg.num_layers, "gpus": ep, "bytes_per_device": per_device,
                         "projected_ms_per_step": per_device / reached * 1e3, "measured_ms_per_step": ms,
                         "measured_bytes": r["bytes"]})
    return rows


def finish(res: dict, t0: float, json_path: str, failed, render) -> int:
    """The run's failures (`failed`), its JSON and markdown (`render`) beside each other; 1 when anything failed."""
    res["total_s"] = time.perf_counter() - t0
    res["failures"] = failed(res)
    common.write_json(json_path, res)
    render(res, json_path[:-len(".json")] + ".md")
    print(json.dumps({"checks": res["checks"], "failures": res["failures"], "total_s": res["total_s"]})[:3000])
    return 1 if res["failures"] else 0


def main(argv=None) -> int:
    args = parse(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.render_only:
        with open(args.render_only) as f:
            res = json.load(f)
        render = write_markdown if "bf16" in res["modes"] else write_quantized_only_markdown  # --quantized-only's
        render(res, os.path.join(args.out, os.path.basename(args.render_only)[:-len(".json")] + ".md"))
        return 1 if "failures" not in res or res["failures"] else 0
    kernels = args.kernels or ("pallas_interpret" if args.smoke else "pallas")
    cfg = ds4jax.tiny() if args.smoke else ds4jax.flash_slice(args.layers)
    gpu = jax.default_backend() != "cpu"
    host_bw, device_bw, device_bw_error = copy_bandwidth() if gpu else (None, None, None)
    res = {"layers": args.layers if not args.smoke else "tiny", "device": str(jax.devices()[0]),
           "jax": jax.__version__, "kernels": kernels, "target": str(device_target()),
           "copy_bandwidth_tb_s": (device_bw or host_bw) / 1e12 if gpu else None,
           "copy_bandwidth_host_timed_tb_s": host_bw / 1e12 if gpu else None,
           "copy_bandwidth_device_timed_tb_s": device_bw / 1e12 if device_bw else None,
           "copy_bandwidth_device_timed_error": device_bw_error,
           "matmul_tflop_s": matmul_flops() / 1e12 if gpu else None, "weight_gb": {}, "modes": {}, "checks": {}}
    bw = (res["copy_bandwidth_tb_s"] or 1.0) * 1e12
    peak = (res["matmul_tflop_s"] or 1.0) * 1e12
    if args.quantized_only:
        return quantized_only(args, res, cfg, kernels, bw, peak)
    json_path = os.path.join(args.out, "quantized.json")
    t0 = time.perf_counter()
    params = jax.jit(lambda k: layer_stack.stacked_params(cfg, P.init(cfg, k, jnp.bfloat16)))(jax.random.key(common.SEED))
    model = Model(cfg, params)
    del params
    res["weight_gb"]["bf16"] = sum(x.nbytes for x in jax.tree.leaves(model.params)) / 1e9
    only = None if args.cases is None else tuple(args.cases.split(","))
    res["modes"]["bf16"], bf16_logits = run_mode(model, kernels, args.smoke, bw, peak, only=only,
                                                 profile=args.profile)
    common.write_json(json_path, res)

    t = time.perf_counter()
    quantized = quantize_model(model, "fp4", fp8_dtype=device_target().fp8_dtype)
    jax.block_until_ready(quantized.params)
    res["quantize_s"] = time.perf_counter() - t
    del model
    gc.collect()
    res["weight_gb"]["fp8_fp4"] = sum(x.nbytes for x in jax.tree.leaves(quantized.params)) / 1e9
    res["modes"]["fp8_fp4"], q_logits = run_mode(quantized, kernels, args.smoke, bw, peak, only=only,
                                                 profile=args.profile)
    common.write_json(json_path, res)
    kv_logits = {}
    if args.fp8_kv:
        decode = tuple(c.name for c in cases(args.smoke) if c.kind == "decode" and (only is None or c.name in only))
        res["modes"][KV_MODE], kv_logits = run_mode(quantized, kernels, args.smoke, bw, peak, only=decode,
                                                    kv_dtype="fp8")
        common.write_json(json_path, res)

    plain = dequantized(quantized)
    del quantized
    gc.collect()
    _, deq_logits = run_mode(plain, kernels, args.smoke, bw, peak, timed=False, only=only)
    for name in bf16_logits:
        pairs = {"fp8_fp4_vs_dequantized": (q_logits, deq_logits), "fp8_fp4_vs_bf16": (q_logits, bf16_logits),
                 "dequantized_vs_bf16": (deq_logits, bf16_logits), "fp8_kv_vs_fp8_fp4": (kv_logits, q_logits),
                 "fp8_kv_vs_bf16": (kv_logits, bf16_logits)}
        res["checks"][name] = {k: compare(a[name], b[name]) for k, (a, b) in pairs.items() if name in a and name in b}
    return finish(res, t0, json_path, failures, write_markdown)


if __name__ == "__main__":
    sys.exit(main())
