"""Distil a checkpoint's MTP draft from its own target: the draft learns to predict what the target would say,
not what the corpus says, and the target's weights stay exactly as they are (bit for bit in the export).

Speculative decoding accepts a draft token when it equals the target's choice (greedy) or in proportion to the
target's probability (sampling), so the draft's useful objective is the target's distribution, not the data's.
`scripts/train_default.py` trained the MTP block on the data (next-next token cross-entropy), so on the default
model the first draft agreed with the target's greedy token in only ~85 % of the speculative rounds
(`docs/benchmarks/speculative_acceptance_cpu.json`). Here, with the target frozen, on corpus windows x:

    teacher_1[t] = target(x[..t+1])           the target's next-token distribution after token t+1
    draft_1[t]   = MTP(target streams at t, x[t+1])                  (what draft extend computes)
    teacher_2[t] = target(x[..t+2])
    draft_2[t]   = MTP(draft_1's streams at t, x[t+2])     (the chain: draft steps 2..k on the draft's own streams)

    loss = KL(teacher_1 || draft_1) + CHAIN_WEIGHT * KL(teacher_2 || draft_2)

Only ``params["mtp"]`` is trained (AdamW on float32 masters, warmup then cosine; the MTP router's selection bias
balanced without an auxiliary loss as in training). The teacher runs in float32 without gradients. The export
is the input checkpoint's directory with ``params.safetensors`` rewritten: every tensor outside ``mtp.`` copied
byte for byte (checked), the ``mtp.`` tensors in their stored dtypes, and ``distill_report.json`` with the
held-out agreement (draft argmax == target argmax, teacher-forced, both chain levels) before and after, measured
on the exported weights.

    python scripts/distill_draft.py --checkpoint checkpoints/default --data build/corpus --out build/distilled \\
        --budget-s 240                                   # a GPU; --data from scripts/default_corpus.py
    python scripts/distill_draft.py --smoke --out /tmp/distilled --steps 4     # CPU: random tiny model
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/: train_default beside this file
import train_default  # noqa: E402
from ds4jax.model.forward import forward_full, mtp_forward_full  # noqa: E402

MIN_STEPS = 20  # a planned run's least, however little of --budget-s the set-up left
CHAIN_WEIGHT = 0.5  # draft steps 2..k: reached only when step 1 was accepted, so weighted below it


# the training script's step-size rule, optimizer and data windows; a fine-tune's own sizes and rates
HYPER = dataclasses.replace(train_default.Hyper(), batch=64, lr=1e-3, weight_decay=0.01)
SMOKE = train_default.SMOKE


# ---- objective --------------------------------------------------------------------------------------------------

def teacher(cfg, params, tokens):
    """The frozen target on tokens [b, T+2]: (log-probabilities [b, T+2, v], last block's streams), no gradient."""
    out = forward_full(cfg, params, tokens)
    return jax.lax.stop_gradient(jax.nn.log_softmax(out.logits.astype(jnp.float32), axis=-1)), \
        jax.lax.stop_gradient(out.hidden[-1])


def _kl(t_logp, d_logits):
    """Mean over positions of KL(teacher || draft), and the draft's argmax == the teacher's per position."""
    d_logp = jax.nn.log_softmax(d_logits.astype(jnp.float32), axis=-1)
    kl = jnp.sum(jnp.exp(t_logp) * (t_logp - d_logp), axis=-1)
    return jnp.mean(kl), jnp.argmax(d_logits, axis=-1) == jnp.argmax(t_logp, axis=-1)


def objective(cfg, mtp, frozen, tokens, t_logp, streams):
    """tokens [b, T+2] and the teacher's outputs on them -> (loss, metrics). See the module docstring."""
    t = tokens.shape[1] - 2
    params = dict(frozen, mtp=mtp)
    d1 = mtp_forward_full(cfg, params, streams[:, :t], tokens[:, 1:t + 1])
    kl1, agree1 = _kl(t_logp[:, 1:t + 1], d1.logits)
    d2 = mtp_forward_full(cfg, params, d1.hidden[-1], tokens[:, 2:t + 2])
    kl2, agree2 = _kl(t_logp[:, 2:t + 2], d2.logits)
    load = jnp.bincount(d1.aux[0].routing.experts.reshape(-1), length=cfg.num_routed_experts)
    return kl1 + CHAIN_WEIGHT * kl2, {"kl": kl1, "chain_kl": kl2, "agree": agree1, "chain_agree": agree2,
                                      "load": load}


@functools.lru_cache(maxsize=4)
def make_step(cfg, hp: train_default.Hyper):
    tx = train_default.optimizer(hp)

    def step_fn(mtp, opt_state, frozen, tokens, step, total):
        t_logp, streams = teacher(cfg, dict(frozen, mtp=mtp), tokens)
        grad_fn = jax.value_and_grad(objective, argnums=1, has_aux=True)
        (loss, m), grads = grad_fn(cfg, mtp, frozen, tokens, t_logp, streams)
        updates, opt_state = tx.update(grads, opt_state, mtp)
        lr = train_default.lr_at(step, total, hp)
        mtp = jax.tree.map(lambda p, u: p - lr * u, mtp, updates)
        load = m["load"].astype(jnp.float32)  # aux-loss-free balancing of the MTP router (train_default's rule)
        ffn = mtp["block"]["ffn"]
        ffn = dict(ffn, bias=ffn["bias"] + train_default.BIAS_RATE * jnp.sign(jnp.mean(load) - load))
        mtp = dict(mtp, block=dict(mtp["block"], ffn=ffn))
        return mtp, opt_state, {"loss": loss, "kl": m["kl"], "chain_kl": m["chain_kl"],
                                "agree": jnp.mean(m["agree"]), "chain_agree": jnp.mean(m["chain_agree"])}

    return jax.jit(step_fn, donate_argnums=(0, 1))


@functools.lru_cache(maxsize=4)
def make_eval(cfg):
    @jax.jit
    def eval_fn(params, tokens):
        t_logp, streams = teacher(cfg, params, tokens)
        _, m = objective(cfg, params["mtp"], {k: v for k, v in params.items() if k != "mtp"}, tokens, t_logp,
                         streams)
        return {"kl": m["kl"] * m["agree"].size, "chain_kl": m["chain_kl"] * m["agree"].size,
                "agree": jnp.sum(m["agree"]), "chain_agree": jnp.sum(m["chain_agree"]), "n": m["agree"].size}

    return eval_fn


def evaluate(cfg, params, wins: np.ndarray, batch: int) -> dict:
    """Teacher-forced agreement of the draft with the target's greedy token over windows [n, T+2]."""
    eval_fn, tot = make_eval(cfg), {"kl": 0.0, "chain_kl": 0.0, "agree": 0.0, "chain_agree": 0.0, "n": 0}
    for i in range(0, len(wins), batch):
        r = jax.device_get(eval_fn(params, jnp.asarray(wins[i:i + batch])))
        for k in tot:
            tot[k] += float(r[k])
    n = max(tot.pop("n"), 1)
    return {k: v / n for k, v in tot.items()} | {"positions": int(n), "windows": int(len(wins))}


# ---- export -----------------------------------------------------------------------------------------------------

def export(checkpoint: str, mtp, out: str, report: dict) -> None:
    """`checkpoint`'s directory with ``params.safetensors`` rewritten: ``mtp.*`` from `mtp` in the stored dtypes,
    every other tensor byte for byte as stored (checked after writing)."""
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    from ds4jax.io.orbax_checkpoint import _flat
    from ds4jax.io.packed_params import PARAMS_FILE

    src = os.path.join(checkpoint, PARAMS_FILE)
    stored = load_file(src)
    with safe_open(src, "np") as f:
        metadata = f.metadata()
    trained = _flat({"mtp": jax.device_get(mtp)})
    if set(trained) != {k for k in stored if k.startswith("mtp.")}:
        raise ValueError(f"the trained MTP tree does not match {src}'s mtp.* tensors")
    tensors = dict(stored)
    for name, value in trained.items():
        tensors[name] = np.asarray(value).astype(stored[name].dtype)
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(checkpoint, tmp)
    save_file(tensors, os.path.join(tmp, PARAMS_FILE), metadata=metadata)
    written = load_file(os.path.join(tmp, PARAMS_FILE))
    changed = [k for k in stored if not k.startswith("mtp.") and written[k].tobytes() != stored[k].tobytes()]
    if changed:
        raise AssertionError(f"target tensors changed in the export: {changed[:5]}")
    with open(os.path.join(tmp, "distill_report.json"), "w") as f:
        json.dump(report, f, indent=1)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def smoke_checkpoint(directory: str, vocab_size: int) -> str:
    """A random tiny model with an MTP block, saved packed (for --smoke and the tests)."""
    import ds4jax
    from ds4jax.io import packed_params
    from ds4jax.model import params as P
    from ds4jax.model.config import AttentionType as A, MlpType
    from ds4jax.model.handle import Model

    cfg = ds4jax.tiny(vocab_size=vocab_size, yarn=None, num_layers=2, attention_types=(A.SLIDING, A.CSA),
                      mlp_types=(MlpType.HASH, MlpType.TOPK))
    packed_params.save(Model(cfg, jax.device_get(P.init(cfg, jax.random.key(0), jnp.bfloat16))), directory,
                       overwrite=True)
    return directory


# ---- main -------------------------------------------------------------------------------------------------------

def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="checkpoints/default", help="a packed checkpoint with an MTP block")
    ap.add_argument("--data", help="directory written by scripts/default_corpus.py (train.npy, heldout.npy)")
    ap.add_argument("--out", required=True, help="the distilled checkpoint's directory (replaced)")
    ap.add_argument("--smoke", action="store_true", help="random tiny model, stdlib bytes (CPU)")
    ap.add_argument("--steps", type=int, default=None, help="total steps (default: as many as fit --budget-s)")
    ap.add_argument("--budget-s", type=float, default=240.0, help="wall-clock budget of the training steps")
    ap.add_argument("--eval-windows", type=int, default=64, help="held-out windows for the agreement figures")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    import ds4jax

    if args.smoke:
        corpus, hp = train_default.smoke_corpus(), SMOKE
        args.checkpoint = smoke_checkpoint(args.out + ".source", corpus.vocab_size)
    else:
        if not args.data:
            ap.error("--data is required unless --smoke")
        corpus, hp = train_default.load_corpus(args.data), HYPER
    model = ds4jax.load(args.checkpoint, dtype=jnp.float32)
    cfg = model.config
    if not model.has_mtp:
        ap.error(f"{args.checkpoint} has no MTP block to distil")
    window = hp.seq_len + 2
    held = train_default.windows(corpus.heldout, window, args.eval_windows)
    before = evaluate(cfg, model.params, held, hp.batch)
    print(f"before: agreement {before['agree']:.4f} / chain {before['chain_agree']:.4f}, KL {before['kl']:.4f}",
          file=sys.stderr, flush=True)

    frozen = {k: v for k, v in model.params.items() if k != "mtp"}
    start = jax.device_get(model.params["mtp"])  # host copy: the steps donate their MTP params
    mtp = jax.device_put(start)
    tx = train_default.optimizer(hp)
    opt_state = tx.init(mtp)
    step_fn = make_step(cfg, hp)

    def run_step(mtp, opt_state, i: int, total: int):
        batch = jnp.asarray(train_default.sample_batch(corpus.train, i, args.seed, hp.batch, window))
        return step_fn(mtp, opt_state, frozen, batch, i, total)

    total = args.steps
    if total is None:  # plan the schedule: compile, warm up, time 20 steps on a throwaway copy, fill the budget
        probe, probe_state = jax.device_put(start), tx.init(jax.device_put(start))
        for i in range(25):
            if i == 5:
                jax.block_until_ready(probe)
                t0 = time.perf_counter()
            probe, probe_state, _ = run_step(probe, probe_state, i, 10**6)
        jax.block_until_ready(probe)
        per_step = (time.perf_counter() - t0) / 20
        total = int(max(MIN_STEPS, (args.budget_s - (time.perf_counter() - t_start)) / (per_step * 1.05)))
        print(f"planned {total} steps ({per_step * 1e3:.1f} ms/step)", file=sys.stderr, flush=True)
        del probe, probe_state
    history, step, stopped_early = [], 0, False
    t_loop = time.perf_counter()
    while step < total:
        mtp, opt_state, scalars = run_step(mtp, opt_state, step, total)
        step += 1
        if step % 100 == 0 or step == total or step == 1:
            h = {"step": step, **{k: float(v) for k, v in jax.device_get(scalars).items()}}
            history.append(h)
            print(f"step {step}/{total}: KL {h['kl']:.4f} chain {h['chain_kl']:.4f}, agreement {h['agree']:.4f} "
                  f"chain {h['chain_agree']:.4f}", file=sys.stderr, flush=True)
            if (args.steps is None and time.perf_counter() - t_start > args.budget_s * 1.15
                    and MIN_STEPS <= step < total):
                stopped_early = True  # the plan was off: keep what is trained (the report says so)
                break
    jax.block_until_ready(mtp)
    train_seconds = time.perf_counter() - t_loop

    report = {"source": os.path.abspath(args.checkpoint), "hyper": dataclasses.asdict(hp),
              "chain_weight": CHAIN_WEIGHT, "steps": step, "tokens_seen": step * hp.batch * hp.seq_len,
              "total_steps": total, "stopped_early": stopped_early,
              "train_seconds": train_seconds, "device": str(jax.devices()[0]), "jax": jax.__version__,
              "before": before, "history": history}
    export(args.checkpoint, mtp, args.out, report)
    after = evaluate(cfg, ds4jax.load(args.out, dtype=jnp.float32).params, held, hp.batch)  # the stored weights
    report["after"] = after
    with open(os.path.join(args.out, "distill_report.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"after: agreement {after['agree']:.4f} / chain {after['chain_agree']:.4f}, KL {after['kl']:.4f} "
          f"({step} steps, {time.perf_counter() - t_start:.0f} s)", file=sys.stderr, flush=True)
    return report


if __name__ == "__main__":
    main()
