"""Where the Engine's warm-up time goes on this device: one cold `Engine(default_model()).warmup()` in this process,
printed as the per-program table plus the split between XLA compile time and the rest (tracing, lowering, runs).
Run it in fresh processes under different XLA_FLAGS / DS4JAX_KERNELS to compare (scripts/gpu_warmup_probe.sh).

    PYTHONPATH=. python scripts/warmup_probe.py --label NAME --out results.jsonl
    python scripts/warmup_probe.py --render results.jsonl   # -> results.md (one row per run)
"""

from __future__ import annotations

import argparse
import json
import os
import time

START = time.perf_counter()


def render(path: str) -> str:
    """Markdown of a results file: one row per run (elapsed warm-up, summed XLA compile seconds, threads)."""
    runs = [json.loads(line) for line in open(path) if line.strip()]
    lines = [f"# Engine warm-up breakdown (`scripts/warmup_probe.py`, default model, max_slots=8, max_context=512)",
             "", f"From `{os.path.basename(path)}`: one fresh process per row, compilation cache off unless the row "
             "says `cached` (a second process on the cache the row before filled). `XLA compile s` sums the programs' "
             "compile times (on a pool they overlap, so it can exceed the elapsed warm-up). Decode tokens/s: 1 and 8 "
             "requests of 64 greedy tokens after warm-up, best of 2 (`--speed`).", "",
             "| run | device | XLA_FLAGS | env | row buckets | programs | compile threads | warmup() elapsed | "
             "XLA compile s | decode tok/s b=1 / b=8 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        threads = r.get("compile_threads", 1)
        speed = r.get("decode_tok_s")
        speed = f"{speed['b1']:,.0f} / {speed['b8']:,.0f}" if speed else "-"
        env = " ".join(f"{k}={v}" for k, v in r.get("env", {}).items()) or r.get("kernels", "-")
        lines.append(f"| {r['label']} | {r['device']} | `{r['xla_flags'] or '-'}` | {env} | "
                     f"{r.get('row_buckets') or 'default'} | {len(r['programs'])} | {threads} | "
                     f"{r['warmup_s']:.1f} s | {r['compile_s']:.1f} s | {speed} |")
    return "\n".join(lines) + "\n"


def decode_speed(engine, model) -> dict:
    """Tokens/s of 1 and 8 requests (64-token prompts, 64 greedy new tokens), best of 2 after one untimed call;
    also whether any compile happened after warm-up (it would make the figure meaningless)."""
    import numpy as np

    from ds4jax.generation.requests import Request

    rng = np.random.default_rng(0)
    out = {}
    for b in (1, 8):
        reqs = [Request(prompt=rng.integers(2, model.config.vocab_size, 64).tolist(), max_new_tokens=64) for _ in range(b)]
        best = None
        for _ in range(3):
            t = time.perf_counter()
            res = engine.generate(reqs)
            dt = time.perf_counter() - t
            assert all(r.ok for r in res), [r.message for r in res if not r.ok]
            best = dt if best is None else min(best, dt)
        out[f"b{b}"] = round(sum(len(r.tokens) for r in res) / best, 1)
    out["compiles_after_warmup"] = engine.stats.compiles_after_warmup
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--render", default=None, help="write RESULTS.md from this results file and exit")
    ap.add_argument("--label")
    ap.add_argument("--out")
    ap.add_argument("--max-slots", type=int, default=8)
    ap.add_argument("--max-context", type=int, default=512)
    ap.add_argument("--speculative", type=int, default=0)
    ap.add_argument("--row-buckets", default=None, help="comma-separated decode row buckets (default: the engine's)")
    ap.add_argument("--speed", action="store_true",
                    help="after warm-up, time 8 requests x 64 greedy tokens (best of 2) so a flag's runtime cost shows")
    args = ap.parse_args()
    if args.render:
        md = os.path.splitext(args.render)[0] + ".md"
        with open(md, "w") as f:
            f.write(render(args.render))
        print(open(md).read())
        return
    if not (args.label and args.out):
        ap.error("--label and --out are needed to measure")
    import jax

    import ds4jax
    from ds4jax.generation.engine import Engine

    t = time.perf_counter()
    model = ds4jax.default_model()
    load_s = time.perf_counter() - t
    rb = tuple(int(x) for x in args.row_buckets.split(",")) if args.row_buckets else None
    engine = Engine(model, max_slots=args.max_slots, max_context=args.max_context, speculative=args.speculative,
                    row_buckets=rb, prefill_row_buckets=rb)
    t = time.perf_counter()
    report = engine.warmup()
    warm_s = time.perf_counter() - t
    print(report.table(), flush=True)
    rec = {"label": args.label, "compile_threads": report.compile_threads, "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "kernels": os.environ.get("DS4JAX_KERNELS", "default"), "device": str(jax.devices()[0]),
           "env": {k: v for k, v in os.environ.items() if k in ("DS4JAX_SCAN_MIN_REPEATS", "DS4JAX_KERNELS")},
           "row_buckets": list(engine.row_buckets),
           "load_s": load_s, "warmup_s": warm_s,
           "compile_s": report.compile_seconds, "compiles": report.compiles, "disk_hits": report.disk_hits,
           "programs": [{"kind": p.kind, "shape": p.shape, "compiles": p.compiles, "compile_s": p.compile_seconds,
                         "wall_s": p.seconds} for p in report.programs],
           "process_s": time.perf_counter() - START}
    if args.speed:
        rec["decode_tok_s"] = decode_speed(engine, model)
    with open(args.out, "a") as f:
        f.write(json.dumps(rec) + "\n")
    print(json.dumps({k: v for k, v in rec.items() if k != "programs"}), flush=True)


if __name__ == "__main__":
    main()
