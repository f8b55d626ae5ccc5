"""How fast a cached ``ds4jax generate`` starts printing: time to the first byte on stdout, total time, CPU time.

Runs the command in fresh processes against one cache directory: a first run that compiles (not timed), then
`--runs` timed runs with our executable cache (the default) and as many with only JAX's persistent cache
(``DS4JAX_EXECUTABLE_CACHE=off``: every process traces and lowers again), interleaved, so both see the same
machine load. Prints a markdown table and writes JSON.

    python scripts/bench_cli_startup.py [--runs 5] [--checkpoint DIR] [--out docs/benchmarks/cli_startup.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

KEYS = ("first_byte_s", "first_byte_cpu_s", "total_s", "cpu_s")

def one_run(argv: list[str], env: dict) -> dict:
    usage0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = proc.stdout.read(1)
    first_at = time.perf_counter() - start
    first_cpu = _process_cpu(proc.pid)
    out = first + proc.stdout.read()
    err = proc.stderr.read()
    code = proc.wait()
    total = time.perf_counter() - start
    usage1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0:
        raise SystemExit(f"{' '.join(argv)} exited {code}: {err.decode(errors='replace')[-2000:]}")
    cpu = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
    return {"first_byte_s": first_at, "first_byte_cpu_s": first_cpu, "total_s": total, "cpu_s": cpu,
            "stdout": out.decode(errors="replace")}


def _process_cpu(pid: int) -> float:
    """User + system CPU seconds of a running process so far (Linux /proc; NaN elsewhere). On a shared machine
    this is the load-independent part of the time to the first byte."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--out", default="docs/benchmarks/cli_startup.json")
    args = parser.parse_args()
    cache = tempfile.mkdtemp(prefix="ds4jax-startup-")
    argv = [sys.executable, "-m", "ds4jax", "generate", "--prompt", "Hello", "--max-new-tokens", "32", "--quiet"]
    if args.checkpoint:
        argv += ["--checkpoint", args.checkpoint]
    base = {**os.environ, "DS4JAX_COMPILATION_CACHE": cache, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    modes = {"ours": base, "jax_cache_only": {**base, "DS4JAX_EXECUTABLE_CACHE": "off"}}
    cold = one_run(argv, base)  # compiles and fills both caches
    one_run(argv, modes["jax_cache_only"])
    results = {m: [] for m in modes}
    loads = []
    for _ in range(args.runs):
        for mode, env in modes.items():
            loads.append(os.getloadavg()[0])
            r = one_run(argv, env)
            assert r["stdout"] == cold["stdout"], "cached runs must print what the compiling run printed"
            results[mode].append(r)
    summary = {m: {k: statistics.median(r[k] for r in rs) for k in KEYS}
               for m, rs in results.items()}
    report = {"argv": argv[1:], "cold_run": {k: cold[k] for k in KEYS},
              "median": summary, "runs": {m: [{k: r[k] for k in KEYS} for r in rs]
                                          for m, rs in results.items()},
              "load_average_1min": {"min": min(loads), "max": max(loads)}, "cpus": os.cpu_count()}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"| cache | first byte on stdout | CPU time to it | total | CPU time |  ({args.runs} runs each, medians; "
          f"load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPUs)")
    print("|---|---|---|---|---|")
    for mode, s in {"none (first run: compiles)": cold, **summary}.items():
        print(f"| {mode} | {s['first_byte_s']:.2f} s | {s['first_byte_cpu_s']:.2f} s | {s['total_s']:.2f} s | "
              f"{s['cpu_s']:.2f} s |")


if __name__ == "__main__":
    main()
