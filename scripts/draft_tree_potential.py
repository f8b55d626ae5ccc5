"""How many tokens a speculative round could yield with a draft tree instead of a chain, on the same draft: a
simulation over plain greedy trajectories, before any tree is built (issue 23 needs ~2.3x plain at batch 1, k = 3).

The speculative round (`ds4jax.generation.spec_rounds`) drafts a chain: d1 from the draft's logits after the
pending token, d2..dk from the draft on its own streams, each its argmax; the target accepts the leading drafts
that equal its greedy tokens, plus one token of its own. On a greedy trajectory the target's tokens are the
trajectory itself, so every accepted path feeds the draft the trajectory's tokens: the draft's predictions along
it can be computed teacher-forced, all positions at once (`mtp_forward_full`, applied level after level on its
own streams, as `scripts/train_default.py` trains the chain). A round from pending position P then accepts d1 if
the level-1 prediction at P-1 is the trajectory's token P+1, d2 if level 2's at P-1 is token P+2, and so on; a tree
whose first level keeps the draft's top `width` candidates accepts d1 if any of them is that token (the branch that
matched continues: its deeper levels are the ones computed here, since their input is that same token).

Approximation: teacher-forced, a level-j draft at position t attends to level-j states of earlier positions,
where the engine's draft pool holds what its draft extends wrote (level 1). The simulated chain's tokens per round
are reported beside the chain measured by the engine on the same prompts (`--measured`): their difference is this
approximation's error.

With --lookup N the same trajectories are replayed with lookup drafting (`ds4jax.generation.lookup`, the rule the
engine runs on the device, here its Python twin): "lookup + chain" drafts a round from the history where the last
>= N tokens occurred before and with the chain otherwise (what `Engine(lookup=N)` does at batch 1), "lookup
alone" only from the history (a round without a match yields the target's one token). Each reports the share of
rounds drafted by lookup: those run no draft-model step.

    python scripts/draft_tree_potential.py --out docs/benchmarks/draft_tree_potential_cpu.json   # CPU, ~1 min
    python scripts/draft_tree_potential.py --lookup 3 --out /tmp/potential.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def draft_levels(cfg, params, seqs: np.ndarray, levels: int, top: int):
    """seqs [b, T] -> (target greedy [b, T], per level j = 1..levels the draft's top `top` ids [b, T-j, top]: at
    position t, level j predicts token t+j+1 from the target's streams at t and tokens t+1..t+j)."""
    import jax
    import jax.numpy as jnp

    from ds4jax.model.forward import forward_full, mtp_forward_full

    @jax.jit
    def run(params, ids):
        out = forward_full(cfg, params, ids)
        tops, streams = [], out.hidden[-1]
        for j in range(1, levels + 1):
            d = mtp_forward_full(cfg, params, streams[:, : ids.shape[1] - j], ids[:, j:])
            tops.append(jax.lax.top_k(d.logits, top)[1])
            streams = d.hidden[-1]
        return jnp.argmax(out.logits, axis=-1), tops

    greedy, tops = run(params, jnp.asarray(seqs))
    return np.asarray(greedy), [np.asarray(t) for t in tops]


def simulate(seq: np.ndarray, tops: list[np.ndarray], start: int, k: int, width: int | None) -> list[int]:
    """Accepted drafts per round along one trajectory `seq` [T] from pending position `start`, a chain of k
    drafts whose first level keeps `width` candidates (width 1: the engine's chain; None: an oracle first level,
    always right, the bound of any first-level tree)."""
    accepted, p, t_end = [], start, len(seq)
    while p + 1 < t_end:
        a = 0
        for j in range(1, k + 1):
            t = p - 1  # level j's prediction at the position before the pending token
            if p + j >= t_end or t < 0 or t >= tops[j - 1].shape[0]:
                break
            candidates = tops[j - 1][t, : (width if j == 1 else 1)]
            if not (j == 1 and width is None) and seq[p + j] not in candidates:
                break
            a += 1
        accepted.append(a)
        p += a + 1
    return accepted


def simulate_lookup(seq: np.ndarray, tops: list[np.ndarray] | None, start: int, k: int, min_n: int,
                    window: int) -> list[tuple[int, bool]]:
    """(accepted drafts, drafted by lookup) per round along `seq` from pending position `start`: the drafts of a
    round are the tokens that followed the latest longest earlier occurrence of the history's suffix (>= min_n
    tokens, the last `window` tokens) when there is one, else the chain's (`tops` as in `simulate`; None: no
    chain, such a round accepts nothing)."""
    from ds4jax.generation.lookup import reference_propose

    seq = [int(t) for t in seq]
    rounds, p = [], start
    while p + 1 < len(seq):
        proposal = reference_propose(seq[max(0, p + 1 - window): p + 1], k, min_n)
        if proposal is not None:
            a = 0
            while a < k and p + 1 + a < len(seq) and seq[p + 1 + a] == proposal[a]:
                a += 1
        elif tops is not None:
            a = simulate(np.asarray(seq[: p + k + 2]), tops, p, k, 1)[0]  # this round's chain alone
        else:
            a = 0
        rounds.append((a, proposal is not None))
        p += a + 1
    return rounds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="checkpoints/default")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--widths", default="1,2,3")
    ap.add_argument("--measured", default="docs/benchmarks/speculative_acceptance_cpu.json",
                    help="a bench_default_speculative.py JSON whose k rows are the engine's chain on these prompts")
    ap.add_argument("--lookup", type=int, default=0, help="also replay lookup drafting of suffixes >= this")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import ds4jax
    from ds4jax.generation.generate import SamplingParams, generate

    jax.config.update("jax_default_matmul_precision", "highest")
    model = ds4jax.load(args.checkpoint, dtype=jnp.float32)
    wins = np.load(os.path.join(args.checkpoint, "heldout_eval.npy")).astype(np.int64)
    prompts = [[int(t) for t in w[: args.prompt_len]] for w in wins[: args.prompts]]
    new = generate(model, prompts, SamplingParams(max_new_tokens=args.new))
    seqs = np.asarray([p + n for p, n in zip(prompts, new)], np.int32)
    widths = [int(w) for w in args.widths.split(",")]
    greedy, tops = draft_levels(model.config, model.params, seqs, args.k, max(widths))
    # the full forward's greedy tokens must be the trajectory's (else the simulation is not on the target's path)
    agree = float(np.mean(greedy[:, args.prompt_len - 1:-1] == seqs[:, args.prompt_len:]))
    res = {"checkpoint": args.checkpoint, "device": str(jax.devices()[0]), "jax": jax.__version__,
           "prompts": len(prompts), "prompt_len": args.prompt_len, "new": args.new, "k": args.k,
           "forward_agrees_with_trajectory": agree, "widths": {}}
    for w in widths + [None]:
        acc = [a for s, tp in zip(seqs, zip(*tops)) for a in simulate(s, list(tp), args.prompt_len, args.k, w)]
        a = np.asarray(acc)
        reached = [int(np.sum(a >= j - 1)) for j in range(1, args.k + 1)]
        res["widths"]["oracle" if w is None else str(w)] = {
            "rounds": int(a.size), "tokens_per_round": float(a.mean() + 1),
            "per_position_acceptance": [float(np.sum(a >= j) / r) if r else None
                                        for j, r in zip(range(1, args.k + 1), reached)],
            "verify_tokens": None if w is None else 1 + w * args.k}  # the pending token + w branches of k drafts
    if args.lookup:
        from ds4jax.generation.lookup import WINDOW

        for name, chained in (("lookup + chain", True), ("lookup alone", False)):
            got = [r for s, tp in zip(seqs, zip(*tops))
                   for r in simulate_lookup(s, list(tp) if chained else None, args.prompt_len, args.k, args.lookup,
                                            WINDOW)]
            a = np.asarray([x for x, _ in got])
            res["widths"][name] = {"rounds": int(a.size), "tokens_per_round": float(a.mean() + 1),
                                   "lookup_rounds": float(np.mean([looked for _, looked in got])),
                                   "min_n": args.lookup, "verify_tokens": 1 + args.k}
    if args.measured and os.path.exists(args.measured):
        with open(args.measured) as f:
            rows = [r for r in json.load(f)["runs"] if r.get("k") == args.k]
        if rows:
            res["measured_chain"] = {"file": args.measured, "tokens_per_round": rows[0]["tokens_per_round"],
                                     "per_position_acceptance": rows[0]["per_position_acceptance"]}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    return 0 if agree > 0.98 else 1


if __name__ == "__main__":
    sys.exit(main())
