"""Does ``ds4jax generate`` stream? The arrival time of every chunk of its stdout, read as the bytes come, for
`--steps-per-call` 1 (the default: one decode step per host call) and 16 (the old fixed one-shot value): the
inter-token gap p50 / p99 against the steady-state step time (decode seconds / tokens after the first).

Each setting runs once to fill the compilation cache, then `--runs` times measured (best TTFT kept per run).

    python scripts/bench_cli_stream.py --out docs/benchmarks [--new 128] [--prompt "def main("] [--runs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np


def one_run(argv: list[str]) -> dict:
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0)
    arrivals, data = [], b""
    while True:
        chunk = os.read(proc.stdout.fileno(), 65536)
        if not chunk:
            break
        arrivals.append(time.perf_counter() - start)
        data += chunk
    code = proc.wait()
    if code != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {code}")
    gaps = np.diff(arrivals)
    steady = (arrivals[-2] - arrivals[0]) / max(len(arrivals) - 2, 1) if len(arrivals) > 2 else float("nan")
    return {"chunks": len(arrivals), "first_chunk_s": round(arrivals[0], 4), "last_chunk_s": round(arrivals[-1], 4),
            "gap_p50_s": round(float(np.percentile(gaps, 50)), 5) if len(gaps) else None,
            "gap_p99_s": round(float(np.percentile(gaps, 99)), 5) if len(gaps) else None,
            "mean_gap_s": round(float(steady), 5), "bytes": len(data)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt", default="def main(")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--name", default="cli_stream")
    args = ap.parse_args(argv)
    rows = []
    for steps in (1, 16):
        cmd = [sys.executable, "-m", "ds4jax", "generate", "--prompt", args.prompt, "--max-new-tokens",
               str(args.new), "--steps-per-call", str(steps), "-q"]
        one_run(cmd)  # fills the compilation cache
        runs = [one_run(cmd) for _ in range(args.runs)]
        best = min(runs, key=lambda r: r["last_chunk_s"])
        rows.append({"steps_per_call": steps, **best, "runs": runs})
        print(json.dumps(rows[-1]), flush=True)
    import jax

    doc = {"device": jax.devices()[0].device_kind, "command": " ".join(["python", *sys.argv]),
           "new_tokens": args.new, "prompt": args.prompt, "load_average_1min": round(os.getloadavg()[0], 2),
           "cpus": os.cpu_count(), "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump(doc, f, indent=1)
    lines = [f"# `ds4jax generate` streaming ({doc['device']})", "", f"`{doc['command']}`", "",
             f"{args.new} new tokens after `{args.prompt}` (default model, greedy, compilation cache warm); stdout "
             f"read as it arrives. {doc['cpus']} CPUs, load average {doc['load_average_1min']} at the end (other "
             "processes share the machine: gaps include their stalls).", "",
             "| --steps-per-call | stdout chunks | first chunk | last chunk | gap p50 | gap p99 | mean gap |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['steps_per_call']} | {r['chunks']} | {r['first_chunk_s']:.2f} s | {r['last_chunk_s']:.2f} s"
                     f" | {1e3 * r['gap_p50_s']:.1f} ms | {1e3 * r['gap_p99_s']:.1f} ms"
                     f" | {1e3 * r['mean_gap_s']:.1f} ms |")
    lines += ["", "The mean gap over the stream is the steady-state time per token (a decode step plus its host "
              "round trip at 1 step per call)."]
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
