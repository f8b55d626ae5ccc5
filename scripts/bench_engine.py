"""Engine benchmark: 64 requests with mixed prompt lengths (128-4096) through one `ds4jax.Engine` on
`flash_slice(4)` (random bf16 weights, MTP block included), plain and speculative decoding.

Reports output tokens/s over the whole workload (wall clock, warm: `engine.warmup()` first and the compile count
after it, which must be 0), per-request latency (time to first token, end to end; p50 / p90 / max) and, for
speculation, acceptance. Correctness: the speculative run's tokens are compared with the plain run's (greedy;
in bf16 the (k+1)-token verify and the 1-token decode round differently, so the shared prefix length is reported,
not asserted) and every request must finish without an error. Results are written as soon as they exist.

    python scripts/bench_engine.py --out docs/benchmarks [--requests 64] [--new 64] [--k 2] [--smoke]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import ds4jax
from ds4jax import Engine, Request
from ds4jax.generation import engine as engine_lib
from ds4jax.model import params as P
from ds4jax.model import layer_stack
from ds4jax.model.handle import Model
from ds4jax.runtime.pool_spec import total_bytes


def pct(xs, q):
    return float(np.percentile(np.asarray(xs, np.float64), q)) if xs else float("nan")


def run(engine: Engine, prompts, new: int, speculative: int | None) -> tuple[dict, list]:
    reqs = [Request(prompt=p, max_new_tokens=new, speculative=speculative) for p in prompts]
    before = engine_lib.compile_count()
    stats0 = dict(vars(engine.stats))
    t = time.perf_counter()
    results = engine.generate(reqs)
    wall = time.perf_counter() - t
    errors = [r.message for r in results if r.error is not None]
    toks = sum(len(r.tokens) for r in results)
    ttft = [r.timings.queue_s + r.timings.prefill_s for r in results]
    e2e = [r.timings.queue_s + r.timings.prefill_s + r.timings.decode_s for r in results]
    delta = {k: v - stats0[k] for k, v in vars(engine.stats).items() if isinstance(v, int)}
    out = {"wall_s": wall, "output_tokens": toks, "output_tokens_per_s": toks / wall,
           "prompt_tokens": sum(len(p) for p in prompts), "errors": errors[:3], "n_errors": len(errors),
           "ttft_s": {"p50": pct(ttft, 50), "p90": pct(ttft, 90), "max": max(ttft)},
           "latency_s": {"p50": pct(e2e, 50), "p90": pct(e2e, 90), "max": max(e2e)},
           "compiles_during_run": engine_lib.compile_count() - before, "engine_counters": delta}
    if speculative != 0:
        acc = [a for r in results for a in (r.accepted_per_round or [])]
        out["mean_accepted"] = float(np.mean(acc)) if acc else 0.0
        out["rounds"] = len(acc)
    return out, [r.tokens for r in results]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--prefill-rows", type=int, default=8)
    ap.add_argument("--steps-per-call", type=int, default=8)
    ap.add_argument("--smoke", action="store_true", help="tiny config, short prompts (CPU check of the script)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.smoke:
        cfg, dtype = ds4jax.tiny(), jnp.float32
        args.min_len, args.max_len, args.prefill_chunk = 8, 64, 32
    else:
        cfg, dtype = ds4jax.flash_slice(4), jnp.bfloat16
    t = time.perf_counter()
    params = jax.jit(lambda k: layer_stack.stacked_params(cfg, P.init(cfg, k, dtype)))(jax.random.key(0))  # no copy
    jax.block_until_ready(params)
    model = Model(cfg, params)
    rng = np.random.default_rng(0)
    # log-uniform prompt lengths in [min, max]: most requests short, a few long
    lengths = np.exp(rng.uniform(np.log(args.min_len), np.log(args.max_len), args.requests)).astype(int)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in lengths]
    results = {"device": str(jax.devices()[0]), "config": "tiny" if args.smoke else "flash_slice(4)",
               "requests": args.requests, "new_tokens": args.new, "k": args.k, "prompt_lengths": lengths.tolist(),
               "init_s": time.perf_counter() - t}
    path = os.path.join(args.out, "engine.json")

    def save():
        with open(path, "w") as f:
            json.dump(results, f, indent=1)

    engine = Engine(model, max_slots=args.requests, max_context=args.max_len + args.new + args.k + 1,
                    speculative=args.k, prefill_chunk=args.prefill_chunk,
                    prefill_tokens=args.prefill_chunk * min(args.prefill_rows, args.requests),
                    row_buckets=(args.requests,), prefill_row_buckets=(min(args.prefill_rows, args.requests),),
                    steps_per_call=args.steps_per_call, snapshot_bytes=0)
    results["kernels"] = engine.kernels.value
    results["pool_bytes"] = {"target": total_bytes(engine.tspec), "draft": total_bytes(engine.dspec)}
    t = time.perf_counter()
    warm = engine.warmup()
    results["warmup_compiles"] = warm.compiles
    results["warmup_programs"] = [dataclasses.asdict(p) for p in warm.programs]
    results["warmup_s"] = time.perf_counter() - t
    save()
    print("warmup", results["warmup_compiles"], f"{results['warmup_s']:.1f}s", flush=True)
    results["plain"], plain = run(engine, prompts, args.new, 0)
    save()
    print("plain", json.dumps(results["plain"]), flush=True)
    results["speculative"], spec = run(engine, prompts, args.new, None)
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y))) for x, y in
              zip(plain, spec)]
    results["speculative"]["shared_prefix_with_plain"] = {"mean": float(np.mean(prefix)), "min": int(min(prefix)),
                                                          "identical_requests": int(sum(x == y for x, y in
                                                                                        zip(plain, spec)))}
    save()
    print("speculative", json.dumps(results["speculative"]), flush=True)
    write_md(results, os.path.join(args.out, "engine.md"))
    return 0 if not results["plain"]["n_errors"] and not results["speculative"]["n_errors"] else 1


def write_md(r: dict, path: str) -> None:
    lines = [f"# Engine: {r['requests']} requests, {r['config']}, {r['device']}", "",
             f"Prompt lengths {min(r['prompt_lengths'])}-{max(r['prompt_lengths'])} (log-uniform, "
             f"{sum(r['prompt_lengths'])} prompt tokens), {r['new_tokens']} new tokens each, greedy, kernels "
             f"{r['kernels']}; warmup {r['warmup_compiles']} compilations in {r['warmup_s']:.0f} s, then "
             f"{r['plain']['compiles_during_run'] + r['speculative']['compiles_during_run']} during the runs.", "",
             "| run | output tok/s | wall s | TTFT p50 / p90 s | latency p50 / p90 / max s | mean accepted |",
             "|---|---|---|---|---|---|"]
    for name in ("plain", "speculative"):
        x = r[name]
        acc = f"{x['mean_accepted']:.2f}" if "mean_accepted" in x else "-"
        lines.append(f"| {name} | {x['output_tokens_per_s']:.1f} | {x['wall_s']:.2f} | {x['ttft_s']['p50']:.2f} / "
                     f"{x['ttft_s']['p90']:.2f} | {x['latency_s']['p50']:.2f} / {x['latency_s']['p90']:.2f} / "
                     f"{x['latency_s']['max']:.2f} | {acc} |")
    s = r["speculative"]["shared_prefix_with_plain"]
    lines += ["", f"Speculative vs plain greedy tokens: {s['identical_requests']} of {r['requests']} requests "
                  f"identical, mean shared prefix {s['mean']:.1f} tokens (bf16: verify and decode shapes round "
                  "differently, so greedy paths may part on near-ties; the fp32 CPU tests assert equality)."]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
