"""A cold one-shot `generate()` of the default model with and without its decode programs compiled ahead
(`ds4jax.generation.compile_ahead`): each run a fresh process, every compilation cache off; the total of a
non-streaming call (which compiles ahead by default) and the first token of a streaming one (which does only under
DS4JAX_COMPILE_AHEAD=always). Writes JSON + markdown; exits 1 when any run's greedy tokens differ.

    python scripts/bench_compile_ahead.py --runs 3 --out docs/benchmarks/compile_ahead_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CASES = (("off", "whole"), ("on", "whole"), ("off", "stream"), ("always", "stream"))  # (setting, call)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = r"""
import json, sys, time
t = time.perf_counter()
from ds4jax import default_model, generate
from ds4jax.generation.generate import SamplingParams
model = default_model()
t1 = time.perf_counter()
first = []
stream = sys.argv[1] == "stream"
out = generate(model, [1] * 18, SamplingParams(max_new_tokens=64),
               on_token=(lambda r, tok: first.append(time.perf_counter())) if stream else None)
t2 = time.perf_counter()
print(json.dumps({"load_s": t1 - t, "first_token_s": first[0] - t1 if first else None, "total_s": t2 - t1,
                  "tokens": out[0]}))
"""


def run(mode: str, call: str) -> dict:
    env = dict(os.environ, DS4JAX_COMPILE_AHEAD=mode, DS4JAX_COMPILATION_CACHE="off", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", CHILD, call], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default="docs/benchmarks/compile_ahead_cpu.json")
    args = ap.parse_args(argv)
    import jax

    meta = {"backend": jax.default_backend(), "cpus": os.cpu_count(), "jax": jax.__version__,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average": list(os.getloadavg())}
    records = []
    for i in range(args.runs):  # interleaved, so drift in the machine's load hits both modes alike
        for mode, call in CASES:
            r = run(mode, call)
            records.append({"run": i, "compile_ahead": mode, "call": call, **r})
            print(json.dumps({k: v for k, v in records[-1].items() if k != "tokens"}), flush=True)
    same = len({json.dumps(r["tokens"]) for r in records}) == 1  # greedy: every run the same tokens
    data = {"meta": meta, "records": records, "same_tokens": same}
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
    med = lambda mode, call, key: statistics.median(r[key] for r in records  # noqa: E731
                                                    if r["compile_ahead"] == mode and r["call"] == call)
    lines = ["# A cold one-shot `generate()`: decode programs compiled ahead or not", "",
             f"Written by `scripts/bench_compile_ahead.py` ({args.runs} fresh processes per row, caches off; "
             f"{meta['backend']}, {meta['cpus']} CPUs, jax {meta['jax']}). Default model, 18-token prompt, 64 greedy "
             "tokens. Medians; every run's tokens equal: " + ("yes" if same else "**no**") + ".", "",
             "| call | DS4JAX_COMPILE_AHEAD | first token | total |", "|---|---|---|---|"]
    for mode, call in CASES:
        first = "-" if call == "whole" else f"{med(mode, call, 'first_token_s'):.2f} s"
        lines.append(f"| {'streaming' if call == 'stream' else 'non-streaming'} | {mode} | {first} | "
                     f"{med(mode, call, 'total_s'):.2f} s |")
    lines += ["", "`on` (the default) compiles ahead for non-streaming calls only; `always` for streaming calls too, "
              "whose prefill compile then shares the cores with the decode program's."]
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
