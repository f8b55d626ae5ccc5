"""Where XLA spends a cold Engine warm-up: the warm-up under the JAX profiler (host tracer only, no Python
tracer), then the compiler's own trace scopes summed by name (inclusive seconds, summed over the compile threads).

    PYTHONPATH=. DS4JAX_COMPILATION_CACHE=off python scripts/compile_phases.py --out phases.json [--top 40] [--cli]

--cli profiles what a cold ``ds4jax generate --prompt "def fibonacci(n):" --max-new-tokens 64`` compiles instead
(the default model, one prompt, one token per host call, as the command streams) rather than the warm-up.

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
    ap.add_argument("--cli", action="store_true", help="the CLI's generate call instead of an Engine warm-up")
    args = ap.parse_args()
    import jax

    import ds4jax
    from ds4jax.generation import compiles
    from ds4jax.generation.engine import Engine

    model = ds4jax.default_model()
    if args.cli:
        from ds4jax.generation.generate import SamplingParams, generate
        from ds4jax.io.default_model import default_tokenizer

        ids = default_tokenizer().encode("def fibonacci(n):", add_bos=True)
        run = lambda: generate(model, ids, SamplingParams(max_new_tokens=64), on_token=lambda r, t: None,  # noqa: E731
                               steps_per_call=1)
    else:
        engine = Engine(model, max_slots=8, max_context=512)
        run = engine.warmup
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    trace_dir = tempfile.mkdtemp(prefix="compile_phases_")
    t = time.perf_counter()
    jax.profiler.start_trace(trace_dir, profiler_options=options)
    try:
        if args.cli:
            before, names = compiles.totals(), compiles.program_compiles()
            run()
            done = compiles.totals() - before
        else:
            report = run()
    finally:
        jax.profiler.stop_trace()
    wall = time.perf_counter() - t
    scopes = scope_totals(trace_dir)
    if args.cli:
        summary = {"compile_s": round(done.seconds, 3), "compiles": done.compiles,
                   "programs": dict(compiles.program_compiles() - names)}
    else:
        summary = {"compile_s": report.compile_seconds, "programs": len(report.programs)}
    rec = {"device": str(jax.devices()[0]), "xla_flags": os.environ.get("XLA_FLAGS", ""), "mode": "cli" if args.cli
           else "warmup", "warmup_s": wall, **summary, "scopes": scopes[: args.top * 3]}
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)
    print(summary if args.cli else report.table())
    for s in scopes[: args.top]:
        print(f"{s['seconds']:9.2f} s {s['count']:6d}  {s['scope']}")


if __name__ == "__main__":
    main()
