"""End-to-end prefill / decode benchmark: ds4jax's pooled steps and HF transformers, measured in one invocation.

Same model on both sides: `flash_slice(--layers)` with ds4jax's seeded random bf16 weights (HF gets the very same
tensors). Each side runs in its own process, one after the other, on the same GPU:

* ``ds4jax`` — this tree (the `after` column);
* ``before`` — the same script against another ds4jax tree (`--before-tree`, e.g. the last main commit before
  a change), so a before/after pair comes from one run;
* ``hf`` — `DeepseekV4ForCausalLM` (eager attention, bf16).

Cases: prefill of 2048 / 8192 tokens at batch 1 and 2048 at batch 8 (last-token logits), greedy decode at batch 1
and 8 after 2048-token prompts (and 32768 for ds4jax). Per case: time, tokens/s, roofline (decode: bytes a step
must read / measured copy bandwidth; prefill: max(weight-read, FLOP time at the measured bf16 matmul rate)),
fraction of it, HF's time from this run and the speedup; for decode a profile of each side (device busy time and
kernels per step, kernels per layer, heaviest kernels). The logits of both sides are compared (last prompt token
and first decode step at batch 1, bf16 tolerance), so a fast wrong kernel cannot pass.

    PYTHONPATH=. python scripts/bench_e2e.py --out docs/benchmarks --commit $(git rev-parse HEAD) \
        [--before-tree PATH] [--layers 4] [--sides before,ds4jax,hf] [--smoke]

Writes OUT/NAME.json (rewritten as results arrive), OUT/NAME.md and OUT/NAME.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import e2e_common as common  # noqa: E402

# bf16 agreement: cosine similarity of the logit vectors. Both sides hold bf16 weights but round activations at
# different places (ds4jax keeps norms, mHC and router in f32; HF casts the whole model to bf16), so elementwise
# errors of ~10 % of max |logit| are normal on random weights; a wrong kernel gives an unrelated vector.
CHECK_MIN_COSINE = 0.99


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--name", default="e2e")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kernels", default="pallas", choices=["pallas", "reference", "pallas_interpret"])
    ap.add_argument("--sides", default="ds4jax,hf", help="comma-separated: before, ds4jax, hf")
    ap.add_argument("--before-tree", default=None, help="root of the ds4jax tree measured as `before`")
    ap.add_argument("--before-label", default="before", help="what the before tree is (e.g. a commit)")
    ap.add_argument("--commit", default=None, help="git commit of this tree (recorded)")
    ap.add_argument("--skip", default="", help="comma-separated case names to skip")
    ap.add_argument("--reuse", default=None, help="a parts directory of an earlier invocation: sides not run now "
                    "(e.g. hf, before) and their check logits are taken from it, and marked so in the output")
    ap.add_argument("--reuse-note", default="", help="where the reused sides were measured")
    ap.add_argument("--smoke", action="store_true", help="tiny config, short sequences (CPU check of the script)")
    ap.add_argument("--side", default=None, help=argparse.SUPPRESS)  # internal: run one side in this process
    ap.add_argument("--label", default="after", help=argparse.SUPPRESS)
    ap.add_argument("--part", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.skip = set(filter(None, args.skip.split(",")))
    return args


def run_side(args, side: str, parts: str) -> dict:
    part = os.path.join(parts, f"{side}.json")
    env = dict(os.environ)
    root = os.path.dirname(HERE)
    label = "after"
    skip = set(args.skip)
    if side == "before":
        if not args.before_tree:
            return {"error": "no --before-tree given"}
        root, label = os.path.abspath(args.before_tree), "before"
        # device time: the before column covers the cases the changes target (decode, one prefill)
        skip |= {"decode_b1_ctx32768", "decode_b8_ctx32768", "prefill_b8_s2048", "prefill_b1_s8192"}
    if side == "hf":  # JAX only initialises the weights here; torch needs the memory afterwards
        env.update(XLA_PYTHON_CLIENT_PREALLOCATE="false", XLA_PYTHON_CLIENT_ALLOCATOR="platform")
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.abspath(__file__), "--side", "hf" if side == "hf" else "ds4jax",
           "--label", label, "--part", part, "--out", args.out, "--layers", str(args.layers),
           "--kernels", args.kernels, "--skip", ",".join(sorted(skip))] + (["--smoke"] if args.smoke else [])
    t = time.perf_counter()
    rc = subprocess.run(cmd, env=env, cwd=root).returncode
    res = json.load(open(part)) if os.path.exists(part) else {}
    res["wall_s"] = time.perf_counter() - t
    if rc:
        res.setdefault("error", f"side {side} exited with status {rc}")
    return res


def check(parts: str) -> dict:
    """Agreement of the sides' logits (bf16 tolerance)."""
    import numpy as np

    out = {"min_cosine": CHECK_MIN_COSINE}
    for what in ("prefill", "decode"):
        try:
            ref = np.load(os.path.join(parts, f"check_{what}_hf.npy"))
            for label in ("after", "before"):
                path = os.path.join(parts, f"check_{what}_{label}.npy")
                if os.path.exists(path):
                    got = np.load(path)
                    if got.shape != ref.shape:
                        out[f"{what}_{label}"] = f"not compared: shapes {got.shape} vs {ref.shape}"
                        continue
                    cos = float(np.dot(got, ref) / (np.linalg.norm(got) * np.linalg.norm(ref)))
                    out[f"{what}_{label}"] = {
                        "cosine": cos, "max_rel_err": float(np.abs(got - ref).max() / np.abs(ref).max()),
                        "argmax_equal": bool(got.argmax() == ref.argmax()), "pass": cos >= CHECK_MIN_COSINE}
        except FileNotFoundError as e:
            out[what] = f"not compared: {e.filename} missing"
    return out


def failures(res: dict) -> list[str]:
    """Why this run's figures cannot be published: a side or case that failed, a logits check that did not pass
    (against HF, or the ds4jax self-check against its reference kernels, every row of every case). Empty = sound."""
    out = [f"side {k}: {v['error']}" for k, v in res["sides"].items() if isinstance(v, dict) and v.get("error")]
    for key, v in res["check"].items():
        if isinstance(v, dict) and not v.get("pass"):
            out.append(f"HF check {key}: cosine {v.get('cosine')}")
    for name, r in res["cases"].items():
        if "error" in r:
            out.append(f"case {name}: {r['error'][:200]}")
        c = r.get("self_check")
        if c is not None and not c.get("pass"):
            out.append(f"case {name}: self-check failed (min cosine {c.get('min_cosine')} over {c.get('rows')} rows, "
                       f"finite {c.get('finite')})")
        if "ms_per_step" in r or "seconds" in r:
            if c is None and res.get("kernels") != "reference":
                out.append(f"case {name}: no self-check recorded")
    return out


def merge(args, sides: dict, parts: str) -> dict:
    ours, hf, before = sides.get("ds4jax", {}), sides.get("hf", {}), sides.get("before", {})
    res = {"commit": args.commit, "command": " ".join(["python"] + sys.argv), "layers": args.layers,
           "reused": {k: v["reused_from"] for k, v in sides.items() if "reused_from" in v},
           "kernels": args.kernels, "before_tree": args.before_label if before else None,
           "sides": {k: {a: b for a, b in v.items() if a != "cases"} for k, v in sides.items()},
           "check": check(parts), "cases": {}}
    for case in common.cases(args):
        if case.name in args.skip and not any(case.name in v.get("cases", {}) for v in sides.values()):
            continue
        r = dict(ours.get("cases", {}).get(case.name, {}))
        h = hf.get("cases", {}).get(case.name)
        key = "seconds" if case.kind == "prefill" else "ms_per_step"
        if h is not None and key in h and key in r:
            r["hf_" + key] = h[key]
            r["hf_measured"] = True
            r["hf_same_invocation"] = "reused_from" not in hf
            r["speedup_vs_hf"] = h[key] / r[key]
            if "profile" in h:
                r["hf_profile"] = h["profile"]
            if "peak_gib" in h:
                r["hf_peak_gib"] = h["peak_gib"]
        elif h is not None and key in h:  # HF only (ds4jax skipped this case in this invocation)
            r["hf_" + key] = h[key]
            r["hf_measured"] = True
            r["hf_same_invocation"] = "reused_from" not in hf
        else:
            r["hf_measured"] = False
            r["hf_note"] = case.note or (h or {}).get("error", hf.get("error", "HF side not run"))[:300]
        b = before.get("cases", {}).get(case.name)
        if b is not None:
            r["before"] = {k: v for k, v in b.items() if k not in ("trace",)}
        res["cases"][case.name] = r
    return res


def _ms(r: dict, key: str) -> float | None:
    if key not in r:
        return None
    return r[key] * 1e3 if key.endswith("seconds") else r[key]


def write_markdown(res: dict, path: str, notes: str | None) -> None:
    s = res["sides"].get("ds4jax", {})
    h = res["sides"].get("hf", {})
    lines = [f"# End to end: ds4jax vs HF transformers, flash_slice({res['layers']}), bf16, random weights", "",
             f"{s.get('device')}; ds4jax: jax {s.get('jax')}, kernels={res['kernels']}, {s.get('params_b', 0):.2f} B "
             f"params (MTP included, not run); HF: transformers {h.get('transformers')}, torch {h.get('torch')}, "
             f"eager attention, {h.get('params_b', 0):.2f} B params. Measured in this run: copy bandwidth "
             f"{common.bandwidth_note(s)}, bf16 matmul "
             f"{s.get('matmul_tflop_s') or 0:.0f} TFLOP/s.",
             "", f"Commit `{res['commit']}`; command: `{res['command']}`", ""]
    for side, where in res.get("reused", {}).items():
        lines += [f"**The `{side}` column was not measured by this invocation**: {where}.", ""]
    lines += [
             "| case | ds4jax | tokens/s | roofline | fraction of roofline | HF transformers | speedup vs HF | "
             f"before ({res['before_tree'] or '-'}) | ds4jax, 8 steps per call (engine) | self-check (rows, min cosine) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in res["cases"].items():
        unit = "ms" if name.startswith("prefill") else "ms/step"
        key = "seconds" if name.startswith("prefill") else "ms_per_step"
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][:100]} | | | | | | | | |")
            continue
        ms, hf_ms = _ms(r, key), _ms(r, "hf_" + key)
        b = r.get("before", {})
        bms = _ms(b, key)
        hf_h = r.get("hf_" + key)
        cells = [name]
        if ms is None:
            cells += ["not run in this invocation", "", "", ""]
        else:
            cells += [f"{ms:.2f} {unit}", f"{r['tokens_per_s']:.0f}", f"{r['roofline_ms']:.2f} ms",
                      f"{100 * r['fraction_of_roofline']:.1f} %"]
        cells += [f"{hf_ms:.2f} {unit}" if hf_ms is not None else "not run",
                  f"{r['speedup_vs_hf']:.2f}x" if "speedup_vs_hf" in r else "",
                  f"{bms:.2f} {unit}" if bms is not None else b.get("error", "-")[:60]]
        loop = r.get("ms_per_step_loop")
        cells.append(f"{loop:.2f} ms/step ({100 * r['fraction_of_roofline_loop']:.1f} % of roofline)"
                     if loop is not None else "-")
        del hf_h
        c = r.get("self_check")
        cells.append(("pass" if c["pass"] else "**FAIL**") + f" ({c['rows']}, {c['min_cosine']:.5f})" if c else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Decode profiles (8 steps traced; per step):", "",
              "| case | side | device busy | kernels | kernels per layer | heaviest kernels (us) |", "|---|---|---|---|---|---|"]
    for name, r in res["cases"].items():
        for side, p in (("ds4jax", r.get("profile")), ("before", r.get("before", {}).get("profile")),
                        ("HF", r.get("hf_profile"))):
            if not p:
                continue
            per_layer = p.get("kernels_per_layer_per_step")
            hlo = r.get("hlo_launches", {}) if side == "ds4jax" else {}
            if per_layer:
                per_layer = ", ".join(f"{v:.0f}" for v in per_layer.values())
            elif hlo.get("per_layer"):  # static count from the compiled step's HLO
                per_layer = (", ".join(str(v) for v in hlo["per_layer"].values())
                             + f" (+{hlo['outside_layers']} outside layers; HLO ops)")
            else:
                per_layer = "-"
            top = "; ".join(f"{k} {v}" for k, v in list(p["top_kernels_us_per_step"].items())[:4])
            lines.append(f"| {name} | {side} | {p['device_busy_ms_per_step']:.2f} ms | {p['kernels_per_step']:.0f} | "
                         f"{per_layer} | {top} |")
    lines += ["", f"Logits agreement with HF (pass: cosine >= {res['check'].get('min_cosine')}; max_rel_err = "
              "max |ours - HF| / max |HF|): `" + json.dumps({k: v for k, v in res["check"].items()
                                                            if k != "min_cosine"}) + "`"]
    lines += ["", "Self-check: every row of every case against ds4jax's reference (pure jnp) kernels on the same "
              "inputs (prefill: last-token logits; decode: the first step on the same pool); the script exits "
              "non-zero when any check fails."]
    if res.get("failures"):
        lines += ["", "**This run failed its checks**; its figures are not valid:", ""]
        lines += [f"* {why}" for why in res["failures"]]
    if notes:
        lines += ["", notes.strip()]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, ctx in zip(axes, (2048, 32768)):
        for label, get, style in (("ds4jax", lambda r: r.get("ms_per_step"), "o-"),
                                  ("ds4jax, 8 steps per call", lambda r: r.get("ms_per_step_loop"), "o-."),
                                  ("ds4jax before", lambda r: r.get("before", {}).get("ms_per_step"), "s--"),
                                  ("HF transformers", lambda r: r.get("hf_ms_per_step"), "^-"),
                                  ("HBM roofline", lambda r: r.get("roofline_ms"), "k:")):
            pts = [(b, get(res["cases"].get(f"decode_b{b}_ctx{ctx}", {}))) for b in (1, 8)]
            pts = [(b, v) for b, v in pts if v is not None]
            if pts:
                ax.plot(*zip(*pts), style, label=label)
        ax.set(title=f"decode, context {ctx}", xlabel="batch", ylabel="ms per step", xticks=[1, 8])
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    args = parse(argv)
    if args.side == "ds4jax":
        import e2e_ds4jax

        args.part_dir = os.path.dirname(args.part)
        return e2e_ds4jax.main(args)
    if args.side == "hf":
        import e2e_hf

        args.part_dir = os.path.dirname(args.part)
        return e2e_hf.main(args)
    os.makedirs(args.out, exist_ok=True)
    parts = os.path.abspath(os.path.join(args.out, f"{args.name}_parts"))
    os.makedirs(parts, exist_ok=True)
    args.out = os.path.abspath(args.out)
    sides = {}
    if args.reuse:
        import shutil

        for name in os.listdir(args.reuse):
            side = name[: -len(".json")]
            if name.endswith(".json") and side not in args.sides.split(","):
                sides[side] = json.load(open(os.path.join(args.reuse, name)))
                sides[side]["reused_from"] = args.reuse_note or args.reuse
            elif name.endswith(".npy"):
                shutil.copy(os.path.join(args.reuse, name), parts)
    for side in filter(None, args.sides.split(",")):
        sides[side] = run_side(args, side, parts)
        res = merge(args, sides, parts)
        common.write_json(os.path.join(args.out, f"{args.name}.json"), res)
    res["failures"] = failures(res)
    common.write_json(os.path.join(args.out, f"{args.name}.json"), res)
    notes_path = os.path.join(args.out, f"{args.name}_notes.md")
    notes = open(notes_path).read() if os.path.exists(notes_path) else None
    write_markdown(res, os.path.join(args.out, f"{args.name}.md"), notes)
    plot(res, os.path.join(args.out, f"{args.name}.png"))
    print(open(os.path.join(args.out, f"{args.name}.md")).read())
    for why in res["failures"]:
        print("FAILED:", why, file=sys.stderr)
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
