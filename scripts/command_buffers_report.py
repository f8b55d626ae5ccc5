"""One table from `scripts/gpu_command_buffers.sh`'s three bench_engine runs (XLA's default command buffers, the
default plus WHILE / CONDITIONAL, none): tokens/s per batch and mode under each setting and the ratio to XLA's
default. Fails (exit 1) when a run is missing or any run failed its own check (speculative tokens equal to plain).

    python scripts/command_buffers_report.py DIR --out docs/benchmarks/command_buffers_h100
"""

from __future__ import annotations

import argparse
import json
import os
import sys

SETTINGS = {"default": "XLA's default set", "while": "default + WHILE, CONDITIONAL (`DS4JAX_COMMAND_BUFFERS=loops`)",
            "off": "none (`DS4JAX_COMMAND_BUFFERS=off`, ROCm's default)"}


def collect(root: str) -> dict:
    res = {"settings": {}, "failures": []}
    for name in SETTINGS:
        path = os.path.join(root, f"cb_{name}", "engine.json")
        if not os.path.exists(path):
            res["failures"].append(f"{name}: no {path}")
            continue
        with open(path) as f:
            run = json.load(f)
        if not run.get("passed", False):
            res["failures"].append(f"{name}: bench_engine's check failed")
        model = run["models"]["default"]
        res["device"], res["jax"] = run["device"], run["jax"]
        res["settings"][name] = {
            "warmup_s": model["warmup_s"],
            "runs": {f"b{r['batch']} {'plain' if r['mode'] == 'plain' else 'k=' + r['mode']}": {
                "tokens_per_s": r["tokens_per_s"], "equal_to_plain": r.get("equal_to_plain"),
                "mean_accepted": r["mean_accepted"], "errors": r["errors"]}
                for r in model["runs"] if r["mode"] in ("plain", "3")}}
    return res


def markdown(res: dict) -> str:
    base = res["settings"].get("default", {}).get("runs", {})
    lines = [(f"# XLA:GPU command buffers and the engine's loops ({res.get('gpu') or res.get('device')}, "
             f"jax {res.get('jax')})"), "",
             ("`OUT=... bash scripts/gpu_command_buffers.sh` then `python scripts/command_buffers_report.py`: the "
             "trained default model through `scripts/bench_engine.py` (fp32, 64-token prompts, 128 new tokens, 4 "
             "prompts one at a time at batch 1, 16 steps / rounds per call, greedy), one fresh process and an empty "
             "compilation cache per setting, one run each (best of 1 after an untimed one)."), "",
             "| setting | warm-up s | " + " | ".join(base) + " |", "|---|---|" + "---|" * len(base)]
    for name, label in SETTINGS.items():
        got = res["settings"].get(name)
        if got is None:
            continue
        cells = []
        for case, ref in base.items():
            r = got["runs"].get(case)
            cells.append("-" if r is None else f"{r['tokens_per_s']:,.0f} ({r['tokens_per_s'] / ref['tokens_per_s']:.2f}x)")
        lines.append(f"| {label} | {got['warmup_s']:.0f} | " + " | ".join(cells) + " |")
    lines += ["", "tokens/s (ratio to XLA's default set). Speculative runs' tokens equal plain greedy in every setting: "
              + ("PASS" if not res["failures"] else "FAIL: " + "; ".join(res["failures"])), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root")
    ap.add_argument("--out", required=True, help="path without extension: writes .json and .md")
    ap.add_argument("--gpu", default=None, help="the GPU's name (default: ROOT/gpu.txt, which the run writes)")
    args = ap.parse_args(argv)
    res = collect(args.root)
    gpu_txt = os.path.join(args.root, "gpu.txt")
    if args.gpu is None and os.path.exists(gpu_txt):
        with open(gpu_txt) as f:
            args.gpu = f.read().strip()
    res["gpu"] = args.gpu
    with open(args.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(res))
    print(markdown(res))
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
