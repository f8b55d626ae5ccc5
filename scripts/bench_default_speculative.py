"""Speculative decoding on the trained default model: greedy acceptance for k = 1..4 on held-out prompts and
speculative vs plain tokens/s at batch 1 and 8, all measured in one run (plain is the baseline of the same run;
every figure the markdown shows comes from that run's JSON).

Prompts are the first --prompt-len tokens of the first --prompts held-out evaluation windows shipped with the
checkpoint (files the model never trained on). At batch b the prompts run in groups of b, one after another, so
batch 1 measures every prompt on its own: tokens/s is all groups' tokens over their summed time, acceptance is
over every round of every prompt. Every timed call is preceded by an identical untimed call (compilation).
Correctness check: the speculative tokens must equal plain greedy decoding (fp32 with exact matmuls by default,
so the two step shapes round identically). Results are written after every measurement, so a run cut short
keeps what it finished.

    python scripts/bench_default_speculative.py --checkpoint checkpoints/default --out docs/benchmarks
    python scripts/bench_default_speculative.py --plot docs/benchmarks/speculative.json   # plot + markdown only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def acceptance_stats(accepted_per_round: list[list[int]], k: int) -> dict:
    """Mean accepted drafts per round, tokens per round (accepted + 1) and per-position acceptance: the share
    of rounds that reached draft j (all drafts before it accepted) in which draft j was accepted too."""
    a = np.asarray([x for req in accepted_per_round for x in req if x >= 0], np.int64)
    if a.size == 0:
        return {"rounds": 0}
    per_pos = []
    for j in range(1, k + 1):
        reached = np.sum(a >= j - 1)
        per_pos.append(float(np.sum(a >= j) / reached) if reached else None)
    return {"rounds": int(a.size), "mean_accepted": float(a.mean()), "tokens_per_round": float(a.mean() + 1),
            "per_position_acceptance": per_pos}


def run(args) -> dict:
    import jax
    import jax.numpy as jnp

    import ds4jax
    from ds4jax.generation.generate import SamplingParams, generate
    from ds4jax.generation.speculative import speculative_generate

    t_start = time.perf_counter()
    if args.precision:
        jax.config.update("jax_default_matmul_precision", args.precision)
    model = ds4jax.load(args.checkpoint, dtype=jnp.dtype(args.dtype))
    wins = np.load(os.path.join(args.checkpoint, "heldout_eval.npy")).astype(np.int64)
    prompts_all = [[int(t) for t in w[: args.prompt_len]] for w in wins[: args.prompts]]
    sp = SamplingParams(max_new_tokens=args.new)  # greedy, no stop ids: every call emits exactly --new tokens
    res = {"device": str(jax.devices()[0]), "jax": jax.__version__, "checkpoint": args.checkpoint,
           "dtype": args.dtype, "matmul_precision": args.precision, "new_tokens": args.new,
           "prompt_len": args.prompt_len, "prompts": len(prompts_all), "repeats": args.repeats, "lookup": args.lookup,
           "runs": []}

    def save():
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)

    def timed(fn, b):
        """Best-of-repeats seconds summed over the prompts' groups of b, and every group's output in order."""
        total, outs = 0.0, []
        for start in range(0, len(prompts_all), b):
            group = prompts_all[start: start + b]
            fn(group)  # compile (and warm caches)
            best, out = float("inf"), None
            for _ in range(args.repeats):
                t = time.perf_counter()
                out = fn(group)
                best = min(best, time.perf_counter() - t)
            total += best
            outs.append(out)
        return total, outs

    batches, ks = [int(x) for x in args.batches.split(",")], [int(x) for x in args.ks.split(",")]
    # most important first (plain and the first k at every batch), so a deadline cuts the least useful runs
    plan = [(b, 0) for b in batches[:1]] + [(batches[0], ks[0])]
    plan += [p for b in batches[1:] for p in ((b, 0), (b, ks[0]))]
    plan += [(b, k) for b in batches for k in ks[1:]]
    plain = {}
    for b, k in plan:
        if k == 0:
            secs, outs = timed(lambda group: generate(model, group, sp), b)
            plain[b] = [t for out in outs for t in out]
            n = sum(map(len, plain[b]))
            res["runs"].append({"batch": b, "k": 0, "seconds": secs, "tokens": n, "tokens_per_s": n / secs})
            print(f"b={b} plain: {n / secs:,.1f} tok/s", flush=True)
            save()
            continue
        if time.perf_counter() - t_start > args.deadline_s:
            print(f"deadline: skipping b={b} k={k}", flush=True)
            continue
        secs, outs = timed(lambda group: speculative_generate(model, group, sp, k=k, lookup=args.lookup), b)
        tokens = [t for out in outs for t in out.tokens]
        n = sum(map(len, tokens))
        equal = [s == p for s, p in zip(tokens, plain[b])]
        row = {"batch": b, "k": k, "seconds": secs, "tokens": n, "tokens_per_s": n / secs,
               "equals_plain_greedy": equal,
               **acceptance_stats([a for out in outs for a in out.accepted_per_round], k)}
        plain_row = next(r for r in res["runs"] if r["batch"] == b and r["k"] == 0)
        row["speedup"] = row["tokens_per_s"] / plain_row["tokens_per_s"]
        res["runs"].append(row)
        print(f"b={b} k={k}: {row['tokens_per_s']:,.1f} tok/s ({row['speedup']:.2f}x), "
              f"{row.get('tokens_per_round', 0):.2f} tokens/round, equal {sum(equal)}/{len(equal)} "
              f"({time.perf_counter() - t_start:.0f} s)", flush=True)
        save()
    res["seconds_total"] = time.perf_counter() - t_start
    res["all_equal_plain"] = all(all(r.get("equals_plain_greedy", [True])) for r in res["runs"])
    save()
    return res


def _table(res: dict) -> str:
    rows = ["| batch | k | tokens/s | speedup vs plain | tokens / round | mean accepted | per-position acceptance | "
            "equals plain greedy |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(res["runs"], key=lambda r: (r["batch"], r["k"])):
        if r["k"] == 0:
            rows.append(f"| {r['batch']} | plain | {r['tokens_per_s']:,.1f} | 1.00x | 1.00 | - | - | - |")
        else:
            pos = ", ".join(f"{p:.2f}" for p in r.get("per_position_acceptance", []) if p is not None)
            eq = r.get("equals_plain_greedy", [])
            rows.append(f"| {r['batch']} | {r['k']} | {r['tokens_per_s']:,.1f} | {r['speedup']:.2f}x | "
                        f"{r.get('tokens_per_round', 0):.2f} | {r.get('mean_accepted', 0):.2f} | {pos} | "
                        f"{sum(eq)}/{len(eq)} |")
    return (f"{res.get('title', res['device'])}: jax {res['jax']}, checkpoint `{res['checkpoint']}` in "
            f"{res['dtype']} (matmul precision {res['matmul_precision']}), greedy, {res['new_tokens']} new tokens "
            f"after {res['prompt_len']}-token held-out prompts ({res.get('prompts', '?')} prompts, in groups of the "
            f"batch size), best of {res['repeats']} timed call(s) after a compiling call; plain decoding measured "
            f"in the same run.\n\n" + "\n".join(rows) + "\n")


def write_markdown_and_plot(results: list[dict], out_dir: str, preface: str = "") -> None:
    preface = preface.rstrip() + "\n\n" if preface.strip() else ""
    text = ("# Speculative decoding on the default model\n\n" + preface
            + "Tokens per round = accepted drafts + 1. Per-position acceptance j = share of rounds reaching draft j "
              "whose draft j was accepted.\n\n" + "\n".join(_table(r) for r in results)
            + "\n![speculative](speculative.png)\n")
    with open(os.path.join(out_dir, "speculative.md"), "w") as f:
        f.write(text)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for res in results:
        name = res.get("short", res["device"])
        for b in sorted({r["batch"] for r in res["runs"]}):
            spec = sorted((r for r in res["runs"] if r["batch"] == b and r["k"] > 0), key=lambda r: r["k"])
            if not spec:
                continue
            ks = [r["k"] for r in spec]
            ax1.plot(ks, [r.get("tokens_per_round", 0) for r in spec], "o-", label=f"{name}, batch {b}")
            ax2.plot(ks, [r["speedup"] for r in spec], "o-", label=f"{name}, batch {b}")
    ax1.set(xlabel="draft tokens k", ylabel="tokens per round", title="greedy acceptance, held-out prompts")
    ax2.axhline(1.0, color="gray", lw=0.8)
    ax2.set(xlabel="draft tokens k", ylabel="speculative / plain tokens/s", title="speedup (same run)")
    for ax in (ax1, ax2):
        ax.set_xticks(range(1, 5))
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "speculative.png"), dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="checkpoints/default")
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--json", default=None, help="result file (default: OUT/speculative.json)")
    ap.add_argument("--ks", default="3,1,2,4", help="the first one is measured first at every batch")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8, help="held-out windows used (every one is measured)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--lookup", type=int, default=0,
                    help="lookup drafting beside the MTP draft (0, this script's default: the MTP draft alone)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--precision", default="highest", help="jax_default_matmul_precision ('' keeps the default)")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="skip remaining speculative runs after this")
    ap.add_argument("--plot", metavar="JSON", nargs="+", help="only write markdown + plot from result files")
    ap.add_argument("--preface", default="", help="markdown put before the tables (with --plot)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    args.json = args.json or os.path.join(args.out, "speculative.json")
    if args.plot:
        results = []
        for path in args.plot:
            with open(path) as f:
                results.append(json.load(f))
    else:
        results = [run(args)]
    try:
        write_markdown_and_plot(results, args.out, args.preface)
    except ImportError as e:  # matplotlib missing on the device: plot later from the JSON
        print(f"no plot: {e}", file=sys.stderr)
    if not all(r.get("all_equal_plain", True) for r in results):
        print("FAIL: speculative greedy tokens differ from plain", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
