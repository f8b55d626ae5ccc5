"""Where XLA spends a cold Engine warm-up: the warm-up under the JAX profiler (host tracer only, no Python
tracer), then the compiler's own trace scopes summed by name (inclusive seconds, summed over the compile threads).

    PYTHONPATH=. DS4JAX_COMPILATION_CACHE=off python scripts/compile_phases.py --out phases.json [--top 40]

The scopes nest (a backend compile contains its HLO passes and its code generation), so the totals overlap; read
them as "how much of the compile is in X", not as a partition. Python-level scopes are excluded.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import tempfile
import time


def scope_totals(trace_dir: str) -> list[dict]:
    """(name, seconds, count) of every non-Python host scope in the newest trace under `trace_dir`."""
    from jax.profiler import ProfileData

    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))[-1]
    seconds, count = collections.Counter(), collections.Counter()
    for plane in ProfileData.from_file(path).planes:
        if not plane.name.startswith("/host"):
            continue
        for line in plane.lines:
            for ev in line.events:
                if ev.name.startswith("$"):  # Python frames
                    continue
                seconds[ev.name] += ev.duration_ns / 1e9
                count[ev.name] += 1
    return [{"scope": k, "seconds": round(v, 3), "count": count[k]} for k, v in seconds.most_common()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    import jax

    import ds4jax
    from ds4jax.generation.engine import Engine

    model = ds4jax.default_model()
    engine = Engine(model, max_slots=8, max_context=512)
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    trace_dir = tempfile.mkdtemp(prefix="compile_phases_")
    t = time.perf_counter()
    jax.profiler.start_trace(trace_dir, profiler_options=options)
    try:
        report = engine.warmup()
    finally:
        jax.profiler.stop_trace()
    wall = time.perf_counter() - t
    scopes = scope_totals(trace_dir)
    rec = {"device": str(jax.devices()[0]), "xla_flags": os.environ.get("XLA_FLAGS", ""), "warmup_s": wall,
           "compile_s": report.compile_seconds, "programs": len(report.programs), "scopes": scopes[: args.top * 3]}
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)
    print(report.table())
    for s in scopes[: args.top]:
        print(f"{s['seconds']:9.2f} s {s['count']:6d}  {s['scope']}")


if __name__ == "__main__":
    main()
