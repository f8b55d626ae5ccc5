"""One table from several `scripts/bench_engine.py` runs of the default model that differ in one setting: tokens/s per
batch and mode under each setting and the ratio to the baseline setting. Fails (exit 1) when a run is missing or any
run failed its own check (speculative tokens equal to plain).

    python scripts/command_buffers_report.py DIR --out docs/benchmarks/command_buffers_h100
        (`scripts/gpu_command_buffers.sh`: XLA's default command buffers, + WHILE / CONDITIONAL, none; DIR/cb_<name>)
    python scripts/command_buffers_report.py DIR --compare greedy_branch --out docs/benchmarks/greedy_branch_cpu
        (DS4JAX_GREEDY_BRANCH=off, then on: DIR/off, DIR/on; `scripts/gpu_round_check.sh`'s branch part)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

COMPARISONS = {
    "command_buffers": dict(
        title="XLA:GPU command buffers and the engine's loops", folder="cb_{}", baseline="default",
        caches="an empty compilation cache per setting",
        run_by="`OUT=... bash scripts/gpu_command_buffers.sh` then `python scripts/command_buffers_report.py`",
        settings={"default": "XLA's default set",
                  "while": "default + WHILE, CONDITIONAL (`DS4JAX_COMMAND_BUFFERS=loops`)",
                  "off": "none (`DS4JAX_COMMAND_BUFFERS=off`, ROCm's default)"}),
    "greedy_branch": dict(
        title="Greedy batches skip the sampling machinery", folder="{}", baseline="off",
        caches=("one compilation cache for both, empty before the first (`off`): the second's warm-up loads the "
                "programs the flag leaves alone"),
        run_by=("`DS4JAX_GREEDY_BRANCH=off|on python scripts/bench_engine.py --out DIR/off|on --models default "
                "--batches 1,8 --ks 3 ...` then `python scripts/command_buffers_report.py DIR --compare greedy_branch`"),
        settings={"off": "top-k / top-p filter and draw run for every position (`DS4JAX_GREEDY_BRANCH=off`)",
                  "on": "a `lax.cond` skips them when no running row samples (`DS4JAX_GREEDY_BRANCH=on`)"}),
}
SETTINGS = COMPARISONS["command_buffers"]["settings"]


def collect(root: str, compare: str = "command_buffers") -> dict:
    spec = COMPARISONS[compare]
    res = {"compare": compare, "settings": {}, "failures": []}
    for name in spec["settings"]:
        path = os.path.join(root, spec["folder"].format(name), "engine.json")
        if not os.path.exists(path):
            res["failures"].append(f"{name}: no {path}")
            continue
        with open(path) as f:
            run = json.load(f)
        if not run.get("passed", False):
            res["failures"].append(f"{name}: bench_engine's check failed")
        model = run["models"]["default"]
        res["device"], res["jax"] = run["device"], run["jax"]
        res["bench"] = {"new_tokens": model.get("new_tokens"), "prompt_len": model.get("prompt_len"),
                        "dtype": model.get("dtype"), "steps_per_call": run.get("steps_per_call"),
                        "repeats": run.get("repeats"), "command": run.get("command")}
        res["settings"][name] = {
            "warmup_s": model["warmup_s"],
            "runs": {f"b{r['batch']} {'plain' if r['mode'] == 'plain' else 'k=' + r['mode']}": {
                "tokens_per_s": r["tokens_per_s"], "equal_to_plain": r.get("equal_to_plain"),
                "mean_accepted": r["mean_accepted"], "errors": r["errors"]}
                for r in model["runs"] if r["mode"] in ("plain", "3")}}
    return res


def markdown(res: dict) -> str:
    spec = COMPARISONS[res.get("compare", "command_buffers")]
    base_name = spec["baseline"]
    base = res["settings"].get(base_name, {}).get("runs", {})
    bench = res.get("bench", {})
    lines = [f"# {spec['title']} ({res.get('gpu') or res.get('device')}, jax {res.get('jax')})", "",
             (f"{spec['run_by']}: the trained default model through `scripts/bench_engine.py` ({bench.get('dtype')}, "
              f"{bench.get('prompt_len')}-token prompts, {bench.get('new_tokens')} new tokens, "
              f"{bench.get('steps_per_call')} steps / rounds per call, greedy), one fresh process per setting, "
              f"{spec['caches']}, best of {bench.get('repeats')} runs after an untimed one."), "",
             "| setting | warm-up s | " + " | ".join(base) + " |", "|---|---|" + "---|" * len(base)]
    for name, label in spec["settings"].items():
        got = res["settings"].get(name)
        if got is None:
            continue
        cells = []
        for case, ref in base.items():
            r = got["runs"].get(case)
            cells.append("-" if r is None else f"{r['tokens_per_s']:,.0f} ({r['tokens_per_s'] / ref['tokens_per_s']:.2f}x)")
        lines.append(f"| {label} | {got['warmup_s']:.0f} | " + " | ".join(cells) + " |")
    lines += ["", f"tokens/s (ratio to `{base_name}`). Speculative runs' tokens equal plain greedy in every setting: "
              + ("PASS" if not res["failures"] else "FAIL: " + "; ".join(res["failures"])), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root")
    ap.add_argument("--out", required=True, help="path without extension: writes .json and .md")
    ap.add_argument("--compare", choices=sorted(COMPARISONS), default="command_buffers")
    ap.add_argument("--gpu", default=None, help="the GPU's name (default: ROOT/gpu.txt, which a GPU run writes)")
    args = ap.parse_args(argv)
    res = collect(args.root, args.compare)
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
