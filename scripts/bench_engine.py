"""Engine benchmark: plain vs fixed k vs the adaptive draft length, at several batch sizes, through one warmed-up
`ds4jax.Engine` per model, with the host time per decode call and the device's busy time.

Models: the trained default model (fp32, exact matmuls; prompts are the first --prompt-len tokens of its
held-out windows, cycled to the batch) and `flash_slice(4)` (random bf16 weights with the MTP block: a random
draft, acceptance ~0, so the adaptive policy must fall back to plain). Every (batch, mode) runs once untimed
(the adaptive policy learns its costs and acceptance there, as it would while serving), then --repeats timed
runs; the best is reported. Greedy throughout.

With --lookup N every speculative mode also runs with lookup drafting (`Engine(lookup=N)`, mode "<k>+lookup" /
"adaptive+lookup"): a greedy row whose history repeats drafts the tokens that followed, and a round whose rows all
did runs no MTP draft step (rows drafted that way and rounds without draft steps are counted per run).

Per run: output tokens/s; decode calls (plain and speculative); per call the device time (each program call is
timed to `block_until_ready`, so it is the device's busy time plus one dispatch) and the host time (the run's
wall time minus every program call's time, per decode call); "fused loop" tok/s = generated tokens / (time in
program calls), what the same programs give without any engine host work between them. Correctness: every
speculative run's tokens are compared with the plain run's; in fp32 a difference fails the run (exit status 1),
in bf16 (verify and decode shapes round differently) the agreement is reported. Results are written after every
measurement (JSON + markdown), so a run cut short keeps what it finished.

    python scripts/bench_engine.py --out docs/benchmarks                  # both models
    python scripts/bench_engine.py --out /tmp/x --smoke                    # a tiny CPU check of the script
    python scripts/bench_engine.py --models default --batches 1,8 --ks 3 --b1-prompts 8 --lookup 3 --out /tmp/x
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ds4jax  # noqa: E402
from ds4jax import Engine, Request  # noqa: E402
from ds4jax.generation import draft_policy  # noqa: E402
from ds4jax.generation.compiles import compile_count  # noqa: E402


class Timer:
    """Wraps the engine's program calls: seconds in each kind of call, to `block_until_ready`, while `enabled`.
    Blocking on each call also stops the engine from running a plain call ahead of the one it reads
    (`generation/run_ahead.py`), so the timed runs that give tokens/s run with the timer off, and one more run
    with it on gives the device and host split."""

    def __init__(self, engine: Engine):
        self.enabled = False
        self.seconds = {"prefill": 0.0, "decode": 0.0, "speculative": 0.0}
        for kind, name in (("prefill", "_prefill_call"), ("decode", "_decode_call"), ("speculative", "_spec_call")):
            real = getattr(engine, name)

            def timed(*args, real=real, kind=kind):
                if not self.enabled:
                    return real(*args)
                t = time.perf_counter()
                out = jax.block_until_ready(real(*args))
                self.seconds[kind] += time.perf_counter() - t
                return out

            setattr(engine, name, timed)

    def reset(self):
        for k in self.seconds:
            self.seconds[k] = 0.0


def measure(engine: Engine, timer: Timer, prompts, new: int, mode, repeats: int,
            one_at_a_time: bool = False) -> tuple[dict, list]:
    """One (batch, mode): an untimed run, then the best of `repeats`. `one_at_a_time`: the prompts are requests
    generated one after another, each alone (batch 1 over several prompts); a run's time is their sum."""
    k_max = engine.k
    looking = mode.endswith("+lookup")
    mode = mode.removesuffix("+lookup")
    engine.lookup = engine.lookup_n if looking else 0  # a static argument of the speculative programs
    if mode == "plain":
        cap = 0
    elif mode == "adaptive":
        engine.policy, cap = engine.adaptive_policy, None
        engine.policy.choices.clear()  # the calls of this (batch, mode): its untimed and timed runs
        engine.policy.trace.clear()
    else:
        engine.policy, cap = draft_policy.Fixed(k_max, engine.adaptive_policy.ks), int(mode)
    reqs = [Request(prompt=p, max_new_tokens=new, speculative=cap) for p in prompts]
    best, split = None, None
    for i in range(repeats + 2):  # untimed, `repeats` timed (timer off), one with the timer on (the split)
        timer.enabled = i == repeats + 1
        s0, c0 = dict(vars(engine.stats)), compile_count()
        timer.reset()
        t = time.perf_counter()
        results = [r for group in ([[q] for q in reqs] if one_at_a_time else [reqs]) for r in engine.generate(group)]
        wall = time.perf_counter() - t
        d = {k: v - s0[k] for k, v in vars(engine.stats).items() if isinstance(v, int)}
        calls = d["decode_calls"] + d["spec_calls"]
        toks = sum(len(r.tokens) for r in results)
        if timer.enabled:
            program_s = sum(timer.seconds.values())
            split = {"device_s": dict(timer.seconds),
                     "device_ms_per_decode_call": 1e3 * (timer.seconds["decode"] + timer.seconds["speculative"])
                     / max(calls, 1),
                     "host_ms_per_decode_call": 1e3 * (wall - program_s) / max(calls, 1),
                     "fused_loop_tokens_per_s": toks / program_s if program_s else None,
                     "timed_run_tokens_per_s": toks / wall, "timed_run_compiles": compile_count() - c0}
            continue
        acc = [a for r in results for a in (r.accepted_per_round or [])]
        row = {"wall_s": wall, "tokens": toks, "tokens_per_s": toks / wall,
               "errors": [r.message for r in results if r.error is not None][:3],
               "decode_calls": d["decode_calls"], "spec_calls": d["spec_calls"], "decode_steps": d["decode_steps"],
               "spec_rounds": d["spec_rounds"], "mean_accepted": float(np.mean(acc)) if acc else None,
               "lookup_drafts": d["lookup_drafts"], "lookup_skips": d["lookup_skips"],
               "compiles": compile_count() - c0}
        if i and (best is None or row["wall_s"] < best["wall_s"]):
            best = row
    best.update(split)
    best["compiles"] += split["timed_run_compiles"]
    timer.enabled = False
    if mode == "adaptive":
        best["choices"] = {str(k): v for k, v in sorted(engine.policy.choices.items())}
        best["trace"] = [list(t) for t in engine.policy.trace]  # the last choices and the speeds behind them
    engine.policy = engine.adaptive_policy
    engine.lookup = engine.lookup_n
    return best, [r.tokens for r in results]


def build(name: str, smoke: bool):
    """(model, prompts source, dtype name) of a benchmark model."""
    from ds4jax.model import layer_stack, params as P
    from ds4jax.model.handle import Model

    if smoke:  # one sliding-window layer and its MTP block: the cheapest compile
        from ds4jax.model.config import AttentionType, MlpType

        cfg = ds4jax.tiny(num_layers=1, attention_types=(AttentionType.SLIDING,), mlp_types=(MlpType.HASH,))
        return Model(cfg, jax.jit(P.init, static_argnums=0)(cfg, jax.random.key(3))), None, "float32"
    if name == "default":
        ckpt = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", "default")
        wins = np.load(os.path.join(ckpt, "heldout_eval.npy")).astype(np.int64)
        return ds4jax.default_model(jnp.float32), wins, "float32"
    cfg = ds4jax.flash_slice(4)
    params = jax.jit(lambda key: layer_stack.stacked_params(cfg, P.init(cfg, key, jnp.bfloat16)))(jax.random.key(0))
    return Model(cfg, jax.block_until_ready(params)), None, "bfloat16"


def bench_model(name: str, args, res: dict, save) -> bool:
    """Every (batch, mode) on one model; returns False when a check failed."""
    t0 = time.perf_counter()
    model, wins, dtype = build(name, args.smoke)
    batches = [int(x) for x in (args.flash_batches if name == "flash" and args.flash_batches else args.batches)
               .split(",")]
    ks = [int(x) for x in (args.flash_ks if name == "flash" and args.flash_ks else args.ks).split(",")]
    new = args.flash_new if name == "flash" else args.new
    rng = np.random.default_rng(0)
    n = max(max(batches), args.b1_prompts)
    if wins is not None:
        prompts = [[int(t) for t in wins[i % len(wins)][: args.prompt_len]] for i in range(n)]
    else:
        prompts = [rng.integers(3, model.config.vocab_size, args.prompt_len).tolist() for _ in range(n)]
    out = res["models"][name] = {"dtype": dtype, "batches": batches, "ks": ks, "new_tokens": new,
                                 "prompt_len": args.prompt_len, "init_s": time.perf_counter() - t0, "runs": []}
    k = max(ks)
    engine = Engine(model, max_slots=max(batches), max_context=args.prompt_len + new + k + 2, speculative=k,
                    adaptive=draft_policy.Adaptive(ks=tuple(ks)), prefill_chunk=args.prompt_len,
                    prefill_tokens=args.prompt_len * max(batches), row_buckets=tuple(batches),
                    prefill_row_buckets=tuple(sorted({1, max(batches)})), steps_per_call=args.steps_per_call,
                    snapshot_bytes=0, lookup=args.lookup)
    engine.adaptive_policy, engine.lookup_n = engine.policy, args.lookup
    t = time.perf_counter()
    warm = engine.warmup()
    out.update(kernels=engine.kernels.value, warmup_s=time.perf_counter() - t, warmup_compiles=warm.compiles,
               warmup_programs=len(warm.programs))
    print(f"{name}: warmup {warm.compiles} compilations, {out['warmup_s']:.1f} s", flush=True)
    save()
    timer, ok = Timer(engine), True
    for b in batches:
        plain = None
        spec_modes = [str(x) for x in ks] + ["adaptive"]
        for mode in ["plain"] + spec_modes + ([f"{m}+lookup" for m in spec_modes] if args.lookup else []):
            if time.perf_counter() - res["started"] > args.deadline_s:
                print(f"deadline: skipping {name} b={b} {mode}", flush=True)
                res.setdefault("skipped", []).append(f"{name} b={b} {mode}")
                continue
            alone = b == 1 and args.b1_prompts > 1
            row, tokens = measure(engine, timer, prompts[:args.b1_prompts] if alone else prompts[:b], new, mode,
                                  args.repeats, one_at_a_time=alone)
            row.update(batch=b, mode=mode, prompts=args.b1_prompts if alone else b)
            if mode == "plain":
                plain = tokens
            else:
                equal = [x == y for x, y in zip(tokens, plain)]
                row["equal_to_plain"] = f"{sum(equal)}/{len(equal)}"
                if dtype == "float32" and not all(equal):
                    ok = False
                    row["check"] = "FAILED: greedy tokens differ from plain (fp32)"
            ok = ok and not row["errors"] and row["compiles"] == 0
            base = next(r for r in out["runs"] if r["batch"] == b and r["mode"] == "plain") if mode != "plain" else row
            row["vs_plain"] = row["tokens_per_s"] / base["tokens_per_s"]
            out["runs"].append(row)
            print(f"{name} b={b} {mode:>8}: {row['tokens_per_s']:9.1f} tok/s ({row['vs_plain']:.2f}x) "
                  f"host {row['host_ms_per_decode_call']:.2f} ms/call, device "
                  f"{row['device_ms_per_decode_call']:.2f} ms/call, calls {row['decode_calls']}+{row['spec_calls']}"
                  f" {row.get('equal_to_plain', '')}", flush=True)
            save()
    return ok


def write_md(res: dict, path: str) -> None:
    lines = [f"# Engine: plain vs fixed k vs adaptive ({res['device']}, jax {res['jax']})", "",
             f"`{res['command']}`, {res['steps_per_call']} steps (rounds) per call. tok/s: best of {res['repeats']} "
             "runs after an untimed one, as a user runs it (plain calls may run ahead of the one the engine reads). "
             "Then one more run blocks on every program call to split the time: host ms/call = wall time outside "
             "the programs per decode call, device ms/call = time in the decode / speculative program per call, "
             "fused loop = tokens / time in programs (what the engine would give with no host time at all).", ""]
    if res.get("skipped"):
        lines += [f"Skipped at the deadline: {', '.join(res['skipped'])}.", ""]
    for name, m in res["models"].items():
        b1 = next((r.get("prompts", 1) for r in m["runs"] if r["batch"] == 1), 1)
        lines += [f"## {name} ({m['dtype']}, {m['prompt_len']}-token prompts, {m['new_tokens']} new tokens, kernels "
                  f"{m.get('kernels')}; warm-up {m.get('warmup_compiles')} compilations in "
                  f"{m.get('warmup_s', 0):.0f} s)", "",
                  f"Batch 1: {b1} prompt(s), one request at a time ({'one prompt: a single case, not an average' if b1 == 1 else 'tok/s over all of them'}).",
                  "",
                  "| batch | mode | tok/s | vs plain | fused loop tok/s | engine / fused | host ms/call "
                  "| device ms/call | plain + spec calls | mean accepted | equal to plain |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in m["runs"]:
            acc = f"{r['mean_accepted']:.2f}" if r["mean_accepted"] is not None else "-"
            fused = r["fused_loop_tokens_per_s"] or 0
            ratio = r["tokens_per_s"] / fused if fused else 0
            mode = r["mode"] if r["mode"].startswith(("plain", "adaptive")) else f"k={r['mode']}"
            if r.get("lookup_drafts"):
                mode += f" [lookup: {r['lookup_drafts']} row-rounds, {r['lookup_skips']} without draft steps]"
            if r["mode"].startswith("adaptive"):
                mode += " (" + ", ".join(f"k{k}: {n}" for k, n in r.get("choices", {}).items()) + ")"
            lines.append(f"| {r['batch']} | {mode} | {r['tokens_per_s']:,.1f} | {r['vs_plain']:.2f}x | {fused:,.1f} | "
                         f"{ratio:.2f} | {r['host_ms_per_decode_call']:.2f} | {r['device_ms_per_decode_call']:.2f} | "
                         f"{r['decode_calls']} + {r['spec_calls']} | {acc} | {r.get('equal_to_plain', '-')} |")
        lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--models", default="default,flash")
    ap.add_argument("--batches", default="1,4,8,16,32")
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--flash-batches", default="", help="batches for flash_slice(4) (default: --batches)")
    ap.add_argument("--flash-ks", default="", help="draft lengths for flash_slice(4) (default: --ks)")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--flash-new", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps-per-call", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--b1-prompts", type=int, default=1,
                    help="batch 1: this many prompts, generated one after another (tok/s over all of them)")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="skip the remaining runs after this")
    ap.add_argument("--smoke", action="store_true", help="the tiny random model, short runs (CPU check)")
    ap.add_argument("--lookup", type=int, default=0,
                    help="also run every speculative mode with lookup drafting of suffixes >= this (0: not)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.models, args.new, args.prompt_len = "default", min(args.new, 8), min(args.prompt_len, 8)
    jax.config.update("jax_default_matmul_precision", "highest")  # fp32 greedy paths comparable across shapes
    os.makedirs(args.out, exist_ok=True)
    res = {"device": str(jax.devices()[0]), "jax": jax.__version__, "command": " ".join(sys.argv),
           "steps_per_call": args.steps_per_call, "repeats": args.repeats, "started": time.perf_counter(),
           "models": {}}
    path = os.path.join(args.out, "engine.json")

    def save():
        with open(path, "w") as f:
            json.dump({k: v for k, v in res.items() if k != "started"}, f, indent=1)
        write_md(res, os.path.join(args.out, "engine.md"))

    ok = all([bench_model(name, args, res, save) for name in args.models.split(",")])
    res["passed"] = ok
    save()
    print("PASS" if ok else "FAIL: see engine.md", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
