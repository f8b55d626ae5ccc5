"""Where a speculative round's device time goes, against a plain decode step: one profiler trace each of the
trained default model generating at batch 1 through a warmed-up `ds4jax.Engine` (plain, then fixed k), the
device's kernels grouped by the op scope XLA records with them: the draft's steps (`draft_step/...`, the MTP
block and its head), each target layer (`target/layer<i>_<kind>`, or `target/layer<i>+<n>j_<kind>` for a scanned
unit's body), a target step's own ops (`target_step/...`: the embedding, the pools' geometry, the head), and
a round's own work outside the steps (`round: proposals, lookup` and `round: acceptance, emit, bookkeeping`, by
`spec_rounds`' two scopes), and everything else (a plain step's sampling, the loop itself, a call's first and last
work: `other`). The kernels outside the steps are listed by name, costliest first, as `other_kernels`.

Per plain decode step and per speculative round: device busy ms, kernels, and kernels / busy us per group; the
wall ms per step / round of the same runs. Greedy speculative tokens must equal plain (fp32): exit 1 otherwise.

    python scripts/spec_anatomy.py --out /tmp/anatomy            # writes spec_anatomy.{json,md}
    python scripts/spec_anatomy.py --out /tmp/anatomy --smoke    # the tiny random model on CPU (no kernels)
    python scripts/spec_anatomy.py --out /tmp/anatomy --command-buffers off   # every kernel visible in the trace
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import sys
import tempfile
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import device_trace


# a layer's scope: layer<i>_<kind> unrolled, layer<i>+<n>j_<kind> for the body of a scanned unit of n layers whose
# first is layer i (its kernels run once per repetition: layers i, i + n, ...; `layer_stack.LayerAt.name`). Ops
# inside a scan body carry the body's own name stack, without the step's ``target`` scope (seen in the lowered
# programs on CPU), so the layer name alone marks a target layer; the leftmost match wins (a draft op says
# ``draft`` before anything else)
_GROUP = re.compile(r"draft|layer\d+(?:\+\d+j)?_[a-z]+")


# a round's own work outside the steps, by the scopes `spec_rounds._round` puts it under (its PROPOSE_SCOPE and
# ACCEPT_SCOPE, spelled out: importing ds4jax here would set XLA_FLAGS before --command-buffers is read)
ROUND_GROUPS = {"round_propose": "round: proposals, lookup", "round_accept": "round: acceptance, emit, bookkeeping"}
# the groups whose kernels the JSON lists by name (`other_kernels`): everything outside the steps
UNNAMED = ("other", *ROUND_GROUPS.values())


def group_of(scope: str) -> str:
    m = _GROUP.search(scope)
    if m is None:  # a target step's own ops outside its layers (`steps._step`'s scope), a round's, the loop's
        if "target_step" in scope:
            return "target/head, embedding, geometry"
        return next((g for s, g in ROUND_GROUPS.items() if s in scope), "other")
    return "draft" if m.group(0) == "draft" else "target/" + m.group(0)


def traced(run) -> tuple[list, float]:
    with tempfile.TemporaryDirectory() as log_dir:
        jax.profiler.start_trace(log_dir)
        t = time.perf_counter()
        try:
            run()
        finally:
            wall = time.perf_counter() - t
            jax.profiler.stop_trace()
        try:
            return device_trace.gpu_events(log_dir), wall
        except RuntimeError:  # CPU: no device stream lines
            return [], wall


def summary(events, units: int, wall: float, scopes: dict[str, str] | None = None) -> dict:
    """Per unit (step / round): wall, busy time, kernels, and kernels / busy time per group (`group_of` the event's
    scope, or the scope the optimized HLO gives its kernel name: `device_trace.hlo_scopes`)."""
    busy, count = collections.Counter(), collections.Counter()
    unnamed, unnamed_ns = collections.Counter(), collections.Counter()
    for name, a, b, scope in events:
        resolved = device_trace.scope_of(name, scope, scopes or {})
        g = group_of(resolved)
        busy[g] += b - a
        count[g] += 1
        if g in UNNAMED:
            key = f"{name} |{resolved.strip()[-160:]}"
            unnamed[key] += 1
            unnamed_ns[key] += b - a
    return {"units": units, "wall_ms": wall / units * 1e3,
            "busy_ms": device_trace.busy_ns((a, b) for _, a, b, _ in events) / units / 1e6,
            "kernels": len(events) / units,
            "groups": {g: {"kernels": count[g] / units, "busy_us": busy[g] / units / 1e3}
                       for g in sorted(count, key=lambda g: -busy[g])},
            # the kernels outside the steps (`other` and a round's own groups) that take the most time, with their
            # scopes (the event's, then the HLO's): [kernels, busy us] per unit
            "other_kernels": {k: [unnamed[k] / units, v / units / 1e3] for k, v in unnamed_ns.most_common(80)}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--lookup", type=int, default=0,
                    help="lookup drafting (`Engine(lookup=)`; 0: MTP rounds only, this script's subject)")
    ap.add_argument("--new", type=int, default=129)
    ap.add_argument("--heldout", type=int, default=None, metavar="I",
                    help="the prompt: held-out window I of the default model (default: the tokens 5, 6, ..., 68)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--command-buffers", choices=("auto", "loops", "on", "off"),
                    help="DS4JAX_COMMAND_BUFFERS for this run (default: as set). A kernel that a command-buffer "
                         "graph replays may not show in the trace: `off` counts every kernel (at off's speed)")
    ap.add_argument("--no-hlo-scopes", dest="hlo_scopes", action="store_false",
                    help="do not dump the optimized HLO to name the scopes of kernels the trace leaves unnamed")
    args = ap.parse_args(argv)
    if args.command_buffers:  # before ds4jax's import sets XLA_FLAGS from it
        os.environ["DS4JAX_COMMAND_BUFFERS"] = args.command_buffers
    # (a temporary folder: XLA dumps thousands of files there, LLVM IR included; only the HLO text is read)
    dump = tempfile.mkdtemp(prefix="spec_anatomy_hlo_") if args.hlo_scopes else None
    if dump:  # before the backend starts: the optimized HLO of the two loops, to map kernels to scopes
        os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text "
                                   "--xla_dump_hlo_module_re=.*(decode_loop|speculative_loop).*").strip()
    import ds4jax

    os.makedirs(args.out, exist_ok=True)
    from ds4jax.io.default_model import default_model

    if args.smoke:
        from ds4jax.model import params as params_lib
        from ds4jax.model.handle import Model
        cfg = ds4jax.tiny()
        model = Model(cfg, params_lib.init(cfg, jax.random.key(0)))
    else:
        model = default_model()
    engine = ds4jax.Engine(model, speculative=args.k, max_slots=1, max_context=256, row_buckets=(1,),
                           prefill_chunk=64, snapshot_bytes=0, steps_per_call=16, lookup=args.lookup)
    engine.warmup()
    prompt = list(range(5, 69))
    if args.heldout is not None and not args.smoke:  # a held-out window of the default model's corpus (64 tokens)
        import numpy as np

        windows = np.load(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints",
                                       "default", "heldout_eval.npy"))
        prompt = [int(t) for t in windows[args.heldout][:64]]
    req = lambda k: [ds4jax.Request(prompt=prompt, max_new_tokens=args.new, speculative=k)]
    plain_ref, spec_ref = engine.generate(req(0)), engine.generate(req(args.k))  # untimed: warm
    box = {}
    plain_events, plain_wall = traced(lambda: box.__setitem__("plain", engine.generate(req(0))))
    spec_events, spec_wall = traced(lambda: box.__setitem__("spec", engine.generate(req(args.k))))
    plain, spec = box["plain"][0], box["spec"][0]
    scopes = {m: device_trace.hlo_scopes(dump, m) if dump else {} for m in ("decode_loop", "speculative_loop")}
    if dump:
        shutil.rmtree(dump, ignore_errors=True)
    rounds = len(spec.accepted_per_round or [])
    res = {"device": str(jax.devices()[0]), "jax": jax.__version__, "k": args.k, "new_tokens": args.new,
           "plain_step": summary(plain_events, len(plain.tokens) - 1, plain_wall, scopes["decode_loop"]),
           "spec_round": summary(spec_events, max(rounds, 1), spec_wall, scopes["speculative_loop"]),
           "hlo_scope_kernels": {m: len(v) for m, v in scopes.items()}, "prompt": args.heldout,
           "lookup": args.lookup, "lookup_skips": engine.stats.lookup_skips,
           "rounds": rounds, "mean_accepted": sum(spec.accepted_per_round or [0]) / max(rounds, 1),
           "equal": plain.tokens == spec.tokens == plain_ref[0].tokens == spec_ref[0].tokens,
           "compiles_after_warmup": engine.stats.compiles_after_warmup,
           "command_buffers": os.environ.get("DS4JAX_COMMAND_BUFFERS", "auto")}
    res["passed"] = bool(res["equal"] and plain.ok and spec.ok and res["compiles_after_warmup"] == 0)
    with open(os.path.join(args.out, "spec_anatomy.json"), "w") as f:
        json.dump(res, f, indent=1)
    p, s = res["plain_step"], res["spec_round"]
    lines = [f"# A speculative round (k={args.k}) against a plain decode step ({res['device']}, jax {res['jax']})", "",
             (f"`python scripts/spec_anatomy.py`: the default model at batch 1, {args.new} new tokens from a 64-token "
             f"prompt, one traced run each after an untimed one; {rounds} rounds, mean accepted "
             f"{res['mean_accepted']:.2f}; command buffers: `DS4JAX_COMMAND_BUFFERS={res['command_buffers']}` "
             "(a kernel that a command-buffer graph replays may not show in a trace: `--command-buffers off` shows "
             "every one)."), "",
             "| | wall ms | busy ms | kernels |", "|---|---|---|---|",
             f"| plain step | {p['wall_ms']:.3f} | {p['busy_ms']:.3f} | {p['kernels']:.0f} |",
             f"| speculative round | {s['wall_ms']:.3f} | {s['busy_ms']:.3f} | {s['kernels']:.0f} |", "",
             "| group | step kernels | step busy us | round kernels | round busy us |", "|---|---|---|---|---|"]
    for g in sorted(set(p["groups"]) | set(s["groups"]), key=lambda g: -s["groups"].get(g, {}).get("busy_us", 0)):
        a, b = p["groups"].get(g, {}), s["groups"].get(g, {})
        lines.append(f"| {g} | {a.get('kernels', 0):.1f} | {a.get('busy_us', 0):.1f} | {b.get('kernels', 0):.1f} | "
                     f"{b.get('busy_us', 0):.1f} |")
    lines += ["", "Check (speculative greedy tokens == plain, no compile after warm-up): "
              + ("PASS" if res["passed"] else "FAIL"), ""]
    with open(os.path.join(args.out, "spec_anatomy.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
