"""Where the Engine's warm-up time goes on this device: one cold `Engine(default_model()).warmup()` in this process,
printed as the per-program table plus the split between XLA compile time and the rest (tracing, lowering, runs).
Run it in fresh processes under different XLA_FLAGS / DS4JAX_KERNELS to compare (scripts/gpu_warmup_probe.sh).

    PYTHONPATH=. python scripts/warmup_probe.py --label NAME --out results.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import time

START = time.perf_counter()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-slots", type=int, default=8)
    ap.add_argument("--max-context", type=int, default=512)
    ap.add_argument("--speculative", type=int, default=0)
    args = ap.parse_args()
    import jax

    import ds4jax
    from ds4jax.generation.engine import Engine

    t = time.perf_counter()
    model = ds4jax.default_model()
    load_s = time.perf_counter() - t
    engine = Engine(model, max_slots=args.max_slots, max_context=args.max_context, speculative=args.speculative)
    t = time.perf_counter()
    report = engine.warmup()
    warm_s = time.perf_counter() - t
    print(report.table(), flush=True)
    rec = {"label": args.label, "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "kernels": os.environ.get("DS4JAX_KERNELS", "default"), "device": str(jax.devices()[0]),
           "load_s": load_s, "warmup_s": warm_s,
           "compile_s": report.compile_seconds, "compiles": report.compiles, "disk_hits": report.disk_hits,
           "programs": [{"kind": p.kind, "shape": p.shape, "compiles": p.compiles, "compile_s": p.compile_seconds,
                         "wall_s": p.seconds} for p in report.programs],
           "process_s": time.perf_counter() - START}
    with open(args.out, "a") as f:
        f.write(json.dumps(rec) + "\n")
    print(json.dumps({k: v for k, v in rec.items() if k != "programs"}), flush=True)


if __name__ == "__main__":
    main()
