"""Train the default model: a small DeepSeek-V4 (SWA, CSA + indexer, HCA; hash and top-k MoE; mHC; MTP) on the
Python standard library, with optax, through ds4jax's own differentiable forward.

    python scripts/default_corpus.py --out build/corpus          # corpus + tokenizer (CPU, once)
    python scripts/train_default.py --data build/corpus --workdir build/train --budget-s 300
    python scripts/train_default.py --smoke --workdir /tmp/smoke --steps 6    # CPU, a few steps

Objective: next-token cross-entropy + 0.3 x the MTP block's next-next-token cross-entropy (DeepSeek-V3's
lambda = 0.3) + 0.15 x the same block applied to its own streams (next-next-next token), which is how the
speculative draft chain uses it for k >= 2. Top-k routers balance load without an auxiliary loss (DeepSeek-V3):
each step moves the selection bias of over-loaded experts down and under-loaded ones up by a fixed amount.
The lightning indexer (whose top-k passes no gradient) learns from DeepSeek-V3.2's distillation loss: KL from
the layer's attention over all compressed entries to the indexer's score softmax, on detached inputs.
Params are float32 masters; the forward runs in bfloat16 (float32 where ds4jax keeps float32).

Resumable: the whole training state is an Orbax checkpoint under --workdir/state (every --save-every-s seconds
and at the end); rerunning the same command continues from it. Without --steps, the first invocation times a
few steps and plans as many as fit in --budget-s; the plan is part of the state. At the end the model is
exported (bfloat16, Orbax, with tokenizer and report) to --workdir/model.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import shutil
import sys
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from ds4jax.io import orbax_checkpoint  # noqa: E402
from ds4jax.model import params as P  # noqa: E402
from ds4jax.model.config import AttentionType, Config, MlpType, tiny  # noqa: E402
from ds4jax.model.forward import embed, forward_full, mtp_forward_full  # noqa: E402
from ds4jax.model.layers import compressor, indexer  # noqa: E402
from ds4jax.model.layers.attention import layer_inv_freq, project_qkv  # noqa: E402
from ds4jax.model.layers.mhc import hc_pre  # noqa: E402
from ds4jax.model.layers.norms import rms_norm  # noqa: E402
from ds4jax.model.handle import Model  # noqa: E402

MTP_WEIGHT = 0.3  # DeepSeek-V3 lambda for the next-next-token loss
CHAIN_WEIGHT = 0.15  # the MTP block on its own streams (speculative draft steps 2..k)
BIAS_RATE = 1e-3  # aux-loss-free balancing: bias update speed gamma
INDEXER_WEIGHT = 1.0  # only the indexer's own weights see this loss (its inputs are detached)
EXTRA_FILES = ("tokenizer.json", "tokenizer_config.json")


def default_config(vocab_size: int) -> Config:
    """~7M parameters (13.9 MB in bfloat16 with the MTP block): every attention kind, 2 hash + 4 top-k MoE layers."""
    A = AttentionType
    return Config(
        vocab_size=vocab_size, hidden_size=256, num_layers=6, num_heads=4, head_dim=64, rope_head_dim=16,
        q_lora_rank=128, o_groups=2, o_lora_rank=64, index_num_heads=4, index_head_dim=32, index_topk=16,
        sliding_window=64, attention_types=(A.SLIDING, A.CSA, A.HCA, A.CSA, A.HCA, A.CSA),
        mlp_types=(MlpType.HASH,) * 2 + (MlpType.TOPK,) * 4, csa_ratio=4, hca_ratio=16,
        num_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, routed_scaling_factor=1.5,
        yarn=None, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1,
    )


@dataclasses.dataclass(frozen=True)
class Hyper:
    batch: int = 128
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    eval_windows: int = 16  # the report's held-out figure (a CPU test recomputes it); plus all windows on GPU


SMOKE = Hyper(batch=4, seq_len=32, lr=3e-3, warmup=1, eval_windows=2)


# ---- data ----------------------------------------------------------------------------------------------------

class Corpus(NamedTuple):
    train: np.ndarray  # token stream
    heldout: np.ndarray
    token_bytes: np.ndarray  # UTF-8 bytes per token id (0 for specials)
    vocab_size: int
    manifest: dict
    directory: str | None  # where tokenizer files live (None in smoke mode)


def load_corpus(directory: str) -> Corpus:
    with open(os.path.join(directory, "manifest.json")) as f:
        manifest = json.load(f)
    tb = np.load(os.path.join(directory, "token_bytes.npy"))
    return Corpus(np.load(os.path.join(directory, "train.npy")), np.load(os.path.join(directory, "heldout.npy")),
                  tb, int(tb.shape[0]), manifest, directory)


def smoke_corpus() -> Corpus:
    """A few standard-library modules as UTF-8 bytes (byte tokenizer ids), held out: the last one."""
    import sysconfig

    from ds4jax.io.tokenizer import ByteTokenizer

    root = sysconfig.get_paths()["stdlib"]
    tok = ByteTokenizer()
    streams = []
    for name in ("textwrap.py", "bisect.py", "colorsys.py"):
        with open(os.path.join(root, name), encoding="utf-8") as f:
            streams.append(np.asarray(tok.encode(f.read(), add_bos=True) + [tok.EOS], np.uint16))
    tb = np.asarray([0] * tok.OFFSET + [1] * 256, np.int32)
    manifest = {"corpus": "smoke: textwrap.py, bisect.py (train), colorsys.py (held out)", "files": []}
    return Corpus(np.concatenate(streams[:2]), streams[2], tb, tok.VOCAB_SIZE, manifest, None)


def windows(stream: np.ndarray, length: int, count: int | None = None) -> np.ndarray:
    """Consecutive non-overlapping windows [n, length] from the start of `stream`."""
    n = stream.size // length if count is None else min(count, stream.size // length)
    return stream[: n * length].reshape(n, length).astype(np.int32)


def sample_batch(stream: np.ndarray, step: int, seed: int, batch: int, length: int) -> np.ndarray:
    """Random windows; the generator is keyed by (seed, step), so a resumed run draws the same batches."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, stream.size - length, batch)
    return stream[starts[:, None] + np.arange(length)].astype(np.int32)


# ---- model, loss, step ---------------------------------------------------------------------------------------

def split(params):
    """(float leaves, integer leaves) as two trees with None holes: only floats are trained."""
    floats = jax.tree.map(lambda x: x if jnp.issubdtype(x.dtype, jnp.floating) else None, params)
    ints = jax.tree.map(lambda x: None if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    return floats, ints


def merge(floats, ints):
    return jax.tree.map(lambda f, i: i if f is None else f, floats, ints, is_leaf=lambda x: x is None)


def compute_params(cfg: Config, params, dtype=jnp.bfloat16):
    """Cast to the forward's dtypes (norms, mHC, sinks, biases stay float32)."""
    return jax.tree.map(lambda x, t: x.astype(t.dtype), params, P.abstract(cfg, dtype))


def cross_entropy(logits, targets):
    """[b, t, v] float32, [b, t] -> (mean nats, per-token nats [b, t], top-1 hits [b, t])."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(nll), nll, jnp.argmax(logits, axis=-1) == targets


def topk_layers(cfg: Config) -> list[int]:
    return [i for i, m in enumerate(cfg.mlp_types) if m is MlpType.TOPK]


def indexer_kl(cfg: Config, p: dict, streams_in: jax.Array) -> jax.Array:
    """Lightning-indexer distillation (DeepSeek-V3.2): KL(main attention over compressed entries || softmax of the
    indexer's scores), per query, averaged over queries that see at least one entry.

    The top-k selection passes no gradient, so without this the indexer would stay at its random init. Inputs
    and the target are detached: the loss trains only the indexer (its query projection, head weights and key
    compressor). The target is the layer's attention probabilities over all causal entries, summed over heads."""
    streams_in = jax.lax.stop_gradient(streams_in)
    _, _, collapsed = hc_pre(streams_in, p["hc_attn"], cfg)
    x = jax.lax.stop_gradient(rms_norm(collapsed, p["attn_norm"], cfg.rms_norm_eps))
    b, t, _ = x.shape
    attn = p["attn"]
    inv_freq = layer_inv_freq(cfg, AttentionType.CSA)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    q_latent, q, _ = jax.tree.map(jax.lax.stop_gradient, project_qkv(x, positions, attn, cfg, inv_freq))
    entries = jax.lax.stop_gradient(compressor.compress_sequence(
        x, attn["compressor"], ratio=cfg.csa_ratio, overlap=True, width=cfg.head_dim, inv_freq=inv_freq,
        eps=cfg.rms_norm_eps))
    n = entries.shape[1]
    causal = jnp.arange(n)[None, None, :] < ((positions + 1) // cfg.csa_ratio)[..., None]  # [b, t, n]
    logits = jnp.einsum("bthd,bnd->bthn", q, entries, preferred_element_type=jnp.float32) * cfg.head_dim**-0.5
    logits = jnp.where(causal[:, :, None, :], logits, -1e30)
    target = jnp.mean(jax.nn.softmax(logits, axis=-1), axis=2)  # [b, t, n]
    target = jax.lax.stop_gradient(jnp.where(causal, target, 0.0))
    keys = compressor.compress_sequence(
        x, attn["indexer"]["compressor"], ratio=cfg.csa_ratio, overlap=True, width=cfg.index_head_dim,
        inv_freq=inv_freq, eps=cfg.rms_norm_eps)
    qi, w = indexer.queries(q_latent, x, positions, attn["indexer"], cfg, inv_freq)
    score = jnp.where(causal, indexer.scores(qi, w, keys, cfg), -1e30)
    logq = jax.nn.log_softmax(score, axis=-1)
    kl = jnp.sum(jnp.where(causal, target * (jnp.log(jnp.maximum(target, 1e-30)) - logq), 0.0), axis=-1)
    seen = jnp.any(causal, axis=-1)
    return jnp.sum(jnp.where(seen, kl, 0.0)) / jnp.maximum(jnp.sum(seen), 1)


def objective(cfg: Config, params, tokens):
    """tokens [b, T+3] -> (loss, metrics). Next token, MTP next-next token, MTP chained (next^3)."""
    x, y1, y2, y3 = tokens[:, :-3], tokens[:, 1:-2], tokens[:, 2:-1], tokens[:, 3:]
    out = forward_full(cfg, params, x)
    ce1, nll1, hit1 = cross_entropy(out.logits, y1)
    mtp = mtp_forward_full(cfg, params, out.hidden[-1], y1)
    ce2, nll2, hit2 = cross_entropy(mtp.logits, y2)
    chain = mtp_forward_full(cfg, params, mtp.hidden[-1], y2)
    ce3, nll3, hit3 = cross_entropy(chain.logits, y3)
    csa = cfg.layers_of(AttentionType.CSA)
    inputs = [embed(params, x, cfg)] + out.hidden[:-1]  # streams entering each layer
    kl = sum(indexer_kl(cfg, params["layers"][i], inputs[i]) for i in csa) / max(len(csa), 1)
    loss = ce1 + MTP_WEIGHT * ce2 + CHAIN_WEIGHT * ce3 + INDEXER_WEIGHT * kl
    routings = [out.aux[i].routing for i in topk_layers(cfg)] + [mtp.aux[0].routing]
    loads = [jnp.bincount(r.experts.reshape(-1), length=cfg.num_routed_experts) for r in routings]
    metrics = {"loss": ce1, "mtp_loss": ce2, "chain_loss": ce3, "indexer_kl": kl, "nll": nll1, "mtp_hit": hit2,
               "hit": hit1, "chain_hit": hit3}
    return loss, (metrics, loads)


def balance_biases(cfg: Config, floats, loads):
    """Aux-loss-free balancing: bias_i += gamma * sign(mean load - load_i) on every top-k router."""
    def nudge(bias, load):
        load = load.astype(jnp.float32)
        return bias + BIAS_RATE * jnp.sign(jnp.mean(load) - load)

    layers = list(floats["layers"])
    for i, load in zip(topk_layers(cfg), loads[:-1]):
        ffn = dict(layers[i]["ffn"], bias=nudge(layers[i]["ffn"]["bias"], load))
        layers[i] = dict(layers[i], ffn=ffn)
    mtp_block = floats["mtp"]["block"]
    mtp_block = dict(mtp_block, ffn=dict(mtp_block["ffn"], bias=nudge(mtp_block["ffn"]["bias"], loads[-1])))
    return dict(floats, layers=layers, mtp=dict(floats["mtp"], block=mtp_block))


def optimizer(hp: Hyper) -> optax.GradientTransformation:
    """Adam direction with clipping and decoupled weight decay on matrices; the step size is applied outside
    (`lr_at`), so the schedule is a pure function of the step and survives a resume unchanged."""
    decay_mask = lambda tree: jax.tree.map(lambda x: x.ndim >= 2, tree)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(b1=0.9, b2=0.95),
                       optax.add_decayed_weights(hp.weight_decay, mask=decay_mask))


def lr_at(step, total, hp: Hyper):
    """Linear warmup, then cosine from hp.lr to hp.lr * min_lr_ratio at `total`."""
    step = jnp.asarray(step, jnp.float32)
    warm = jnp.minimum(1.0, (step + 1) / max(hp.warmup, 1))
    frac = jnp.clip((step - hp.warmup) / jnp.maximum(total - hp.warmup, 1), 0.0, 1.0)
    cos = hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + jnp.cos(jnp.pi * frac))
    return hp.lr * warm * jnp.where(step < hp.warmup, 1.0, cos)


@functools.lru_cache(maxsize=4)  # one compilation per (config, hyper) in a process (tests rerun main)
def make_train_step(cfg: Config, hp: Hyper):
    tx = optimizer(hp)

    def loss_fn(floats, ints, tokens):
        return objective(cfg, compute_params(cfg, merge(floats, ints)), tokens)

    def step_fn(floats, opt_state, ints, tokens, step, total):
        (_, (metrics, loads)), grads = jax.value_and_grad(loss_fn, has_aux=True)(floats, ints, tokens)
        updates, opt_state = tx.update(grads, opt_state, floats)
        lr = lr_at(step, total, hp)
        floats = jax.tree.map(lambda p, u: p - lr * u, floats, updates)
        floats = balance_biases(cfg, floats, loads)
        scalars = {k: v for k, v in metrics.items() if v.ndim == 0}
        scalars["lr"] = lr
        scalars["grad_norm"] = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
        return floats, opt_state, scalars

    return jax.jit(step_fn, donate_argnums=(0, 1))


@functools.lru_cache(maxsize=4)
def make_eval(cfg: Config):
    @jax.jit
    def eval_fn(params, tokens):
        """Sums over the batch: nats, tokens, next-token hits, MTP hits, chained MTP hits, per-token nats."""
        _, (m, _) = objective(cfg, params, tokens)
        return {"nats": jnp.sum(m["nll"]), "tokens": m["nll"].size, "hit": jnp.sum(m["hit"]),
                "mtp_hit": jnp.sum(m["mtp_hit"]), "chain_hit": jnp.sum(m["chain_hit"])}

    return eval_fn


def evaluate(eval_fn, params, wins: np.ndarray, token_bytes: np.ndarray, batch: int) -> dict:
    """Held-out loss (nats/token), bits per byte and top-1 accuracies over `wins` [n, T+3]."""
    tot = {"nats": 0.0, "tokens": 0, "hit": 0, "mtp_hit": 0, "chain_hit": 0}
    for i in range(0, len(wins), batch):
        chunk = wins[i:i + batch]
        r = jax.device_get(eval_fn(params, jnp.asarray(chunk)))
        for k in tot:
            tot[k] += float(r[k])
    n_bytes = int(sum(token_bytes[w[1:-2]].sum() for w in wins))  # bytes of the next-token targets
    return {"loss": tot["nats"] / tot["tokens"], "bits_per_byte": tot["nats"] / math.log(2) / n_bytes,
            "top1": tot["hit"] / tot["tokens"], "mtp_top1": tot["mtp_hit"] / tot["tokens"],
            "mtp_chain_top1": tot["chain_hit"] / tot["tokens"], "tokens": tot["tokens"], "bytes": n_bytes,
            "windows": int(len(wins))}


def eval_windows(corpus: Corpus, hp: Hyper, count: int | None) -> np.ndarray:
    """The first `count` held-out windows (all when None), a multiple of hp.eval_windows (one compiled shape)."""
    wins = windows(corpus.heldout, hp.seq_len + 3, count)
    return wins[: len(wins) // hp.eval_windows * hp.eval_windows]


# ---- state: Orbax checkpoint of everything needed to resume ----------------------------------------------------

class State(NamedTuple):
    floats: Any
    opt_state: Any
    ints: Any


def _manager(workdir: str):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(os.path.join(os.path.abspath(workdir), "state"),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=2),
                                 item_names=("state", "meta"))


def save_state(mngr, step: int, state: State, meta: dict) -> None:
    import orbax.checkpoint as ocp

    host = jax.tree.map(np.asarray, state._asdict())
    try:
        mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(host), meta=ocp.args.JsonSave(meta)))
    except Exception as e:  # resumability is worth less than finishing the run and exporting the model
        print(f"warning: could not save the training state at step {step}: {type(e).__name__}: {e}", file=sys.stderr)


def restore_state(mngr, like: State) -> tuple[State, dict] | None:
    import orbax.checkpoint as ocp

    step = mngr.latest_step()
    if step is None:
        return None
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), like._asdict())
    got = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                     meta=ocp.args.JsonRestore()))
    s = got["state"]
    return State(s["floats"], s["opt_state"], s["ints"]), got["meta"]


# ---- main ----------------------------------------------------------------------------------------------------

def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", help="directory written by scripts/default_corpus.py")
    ap.add_argument("--workdir", required=True, help="state/ (resume), model/ (export) and report files")
    ap.add_argument("--smoke", action="store_true", help="tiny config, a few stdlib files, byte tokenizer (CPU)")
    ap.add_argument("--steps", type=int, default=None, help="total steps (default: planned from --budget-s)")
    ap.add_argument("--budget-s", type=float, default=300.0, help="wall-clock budget of this invocation")
    ap.add_argument("--save-every-s", type=float, default=90.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--all-heldout", action="store_true", help="also evaluate every held-out window at the end")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    try:
        from tqdm.auto import tqdm
    except ImportError:  # progress is a nicety; never lose a run over it
        tqdm = _NoBar

    if args.smoke:
        corpus, hp = smoke_corpus(), SMOKE
        A = AttentionType  # three layers still cover every attention kind and both routings; compiles faster
        cfg = tiny(vocab_size=corpus.vocab_size, yarn=None, num_layers=3, attention_types=(A.SLIDING, A.CSA, A.HCA),
                   mlp_types=(MlpType.HASH, MlpType.TOPK, MlpType.TOPK))
    else:
        if not args.data:
            ap.error("--data is required unless --smoke")
        corpus, hp = load_corpus(args.data), Hyper()
        cfg = default_config(corpus.vocab_size)
    if args.batch:
        hp = dataclasses.replace(hp, batch=args.batch)
    os.makedirs(args.workdir, exist_ok=True)
    tx = optimizer(hp)
    params = jax.device_get(P.init(cfg, jax.random.key(args.seed), jnp.float32))  # host copy: steps donate
    floats, ints = split(params)
    state = State(floats, tx.init(floats), ints)
    mngr = _manager(args.workdir)
    restored = restore_state(mngr, state)
    meta = {"step": 0, "total_steps": args.steps, "tokens_seen": 0, "train_seconds": 0.0, "history": [],
            "evals": [], "invocations": 0}
    if restored is not None:
        state, meta = restored
        if args.steps is not None:
            meta["total_steps"] = args.steps  # asked to train further: the schedule stretches to the new total
        print(f"resuming at step {meta['step']} of {meta['total_steps']}", file=sys.stderr)
    meta["invocations"] += 1
    step_fn, eval_fn = make_train_step(cfg, hp), make_eval(cfg)
    curve_wins = eval_windows(corpus, hp, hp.eval_windows)
    window = hp.seq_len + 3
    tokens_per_step = hp.batch * hp.seq_len
    floats, opt_state, ints = state
    floats, opt_state, ints = jax.device_put((floats, opt_state, ints))

    def run_step(step, total):
        nonlocal floats, opt_state
        batch = jnp.asarray(sample_batch(corpus.train, step, args.seed, hp.batch, window))
        floats, opt_state, scalars = step_fn(floats, opt_state, ints, batch, step, total)
        return scalars

    def curve_eval(step):
        params_now = compute_params(cfg, merge(floats, ints))
        r = evaluate(eval_fn, params_now, curve_wins, corpus.token_bytes, hp.eval_windows)
        meta["evals"].append({"step": step, "tokens_seen": meta["tokens_seen"], **r})
        return r

    reserve = 25.0 if not args.smoke else 0.0  # final evaluation, export and save
    step = meta["step"]
    if meta["total_steps"] is None:  # plan: compile, time 10 steps, fill the budget
        planning_total = 10**6
        jax.block_until_ready(run_step(step, planning_total))
        t0 = time.perf_counter()
        timed = 10
        for i in range(1, timed + 1):
            scalars = run_step(step + i, planning_total)
        jax.block_until_ready(scalars)
        per_step = (time.perf_counter() - t0) / timed
        left = args.budget_s - (time.perf_counter() - t_start) - reserve
        meta["total_steps"] = int(step + timed + 1 + max(0, left / (per_step * 1.08)))  # 8 %: evals, logging
        # the planning steps ran at warmup learning rates of the planned schedule's first steps: restart cleanly
        fresh, _ = split(params)
        floats, opt_state = jax.device_put((fresh, tx.init(fresh)))
        print(f"planned {meta['total_steps']} steps ({per_step * 1e3:.1f} ms/step, "
              f"{tokens_per_step / per_step:,.0f} tokens/s)", file=sys.stderr)
    total = int(meta["total_steps"])
    eval_every = max(1, total // 12)
    bar = tqdm(total=total, initial=step, desc="train", mininterval=5.0, file=sys.stderr)
    last_save, t_loop, loop_tokens = time.perf_counter(), time.perf_counter(), 0
    pending = []
    stopped_early = False
    while step < total:
        scalars = run_step(step, total)
        step += 1
        meta["tokens_seen"] += tokens_per_step
        loop_tokens += tokens_per_step
        pending.append((step, scalars))
        if step % 10 == 0 or step == total:
            for s, sc in jax.device_get(pending):
                meta["history"].append({"step": s, **{k: float(v) for k, v in sc.items()}})
            pending = []
            h = meta["history"][-1]
            rate = loop_tokens / (time.perf_counter() - t_loop)
            bar.set_postfix(loss=f"{h['loss']:.3f}", mtp=f"{h['mtp_loss']:.3f}", idx=f"{h['indexer_kl']:.3f}",
                            tok_s=f"{rate:,.0f}")
            bar.update(step - bar.n)
        if step % eval_every == 0 or step == total:
            curve_eval(step)
        now = time.perf_counter()
        if step < total and now - t_start > args.budget_s - reserve:
            stopped_early = True
            break
        if now - last_save > args.save_every_s and step < total:
            meta["step"] = step
            save_state(mngr, step, State(floats, opt_state, ints), meta)
            last_save = now
    bar.close()
    for s, sc in jax.device_get(pending):
        meta["history"].append({"step": s, **{k: float(v) for k, v in sc.items()}})
    train_seconds = time.perf_counter() - t_loop
    meta["train_seconds"] += train_seconds
    meta["step"] = step
    meta["last_tokens_per_s"] = loop_tokens / max(train_seconds, 1e-9)
    save_state(mngr, step, State(floats, opt_state, ints), meta)
    try:
        mngr.wait_until_finished()
    except Exception as e:
        print(f"warning: training state not saved: {type(e).__name__}: {e}", file=sys.stderr)
    report = export(args, cfg, hp, corpus, meta, floats, ints, eval_fn, stopped_early)
    print(f"done: step {step}/{total}, held-out loss {report['heldout']['loss']:.4f} nats/token, "
          f"{report['heldout']['bits_per_byte']:.4f} bits/byte, MTP top-1 {report['heldout']['mtp_top1']:.3f} "
          f"({time.perf_counter() - t_start:.0f} s)", file=sys.stderr)
    return report


def export(args, cfg, hp, corpus, meta, floats, ints, eval_fn, stopped_early) -> dict:
    """bfloat16 model (Orbax) + tokenizer + report into --workdir/model; evaluation of exactly those weights."""
    params = compute_params(cfg, merge(floats, ints))
    # evaluated as the training loop's curve evaluations are (per-layer params: the program they compiled); the
    # Model below holds the same arrays stacked for its scanned layers, another program to trace and compile
    model = Model(cfg, jax.device_get(params))
    wins = eval_windows(corpus, hp, hp.eval_windows)
    heldout = evaluate(eval_fn, params, wins, corpus.token_bytes, hp.eval_windows)
    report = {
        "corpus": corpus.manifest.get("corpus"), "license": corpus.manifest.get("license"),
        "corpus_summary": corpus.manifest.get("summary"),
        "corpus_manifest_sha256": _manifest_hash(corpus),
        "config": cfg.to_hf_dict(), "hyper": dataclasses.asdict(hp),
        "objective": {"mtp_weight": MTP_WEIGHT, "chain_weight": CHAIN_WEIGHT, "bias_rate": BIAS_RATE,
                      "indexer_weight": INDEXER_WEIGHT},
        "parameters": P.count(model.params), "steps": meta["step"], "total_steps": meta["total_steps"],
        "tokens_seen": meta["tokens_seen"], "train_seconds": meta["train_seconds"],
        "tokens_per_s": meta.get("last_tokens_per_s"), "invocations": meta["invocations"],
        "stopped_early": stopped_early, "device": str(jax.devices()[0]), "jax": jax.__version__,
        "heldout": heldout, "history": meta["history"], "evals": meta["evals"],
    }
    if args.all_heldout:
        report["heldout_all"] = evaluate(eval_fn, params, eval_windows(corpus, hp, None), corpus.token_bytes,
                                         hp.eval_windows)
    # the same weights twice: Orbax and, as insurance, safetensors (ds4jax.save); checkpoints/default ships the Orbax
    # export converted to our packed format (`ds4jax convert model DIR --to packed`: it loads in one read)
    for out, write in ((os.path.join(args.workdir, "model_safetensors"), _save_safetensors),
                       (os.path.join(args.workdir, "model"), _save_orbax)):
        try:
            write(model, out)
        except Exception as e:
            print(f"warning: export to {out} failed: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        if corpus.directory:
            for name in EXTRA_FILES + ("manifest.json",):
                shutil.copy2(os.path.join(corpus.directory, name),
                             os.path.join(out, "corpus_manifest.json" if name == "manifest.json" else name))
        np.save(os.path.join(out, "heldout_eval.npy"), wins.astype(np.uint16))
        with open(os.path.join(out, "train_report.json"), "w") as f:
            json.dump(report, f, indent=1)
    return report


def _save_orbax(model: Model, out: str) -> None:
    orbax_checkpoint.save(model, out, overwrite=True)


def _save_safetensors(model: Model, out: str) -> None:
    from ds4jax.io.checkpoint import save

    shutil.rmtree(out, ignore_errors=True)
    save(model, out)


class _NoBar:
    def __init__(self, total=None, initial=0, **_):
        self.n = initial

    def set_postfix(self, **kw):
        print(" ".join(f"{k}={v}" for k, v in kw.items()), f"step={self.n}", file=sys.stderr, flush=True)

    def update(self, n):
        self.n += n

    def close(self):
        pass


def _manifest_hash(corpus: Corpus) -> str | None:
    if not corpus.directory:
        return None
    with open(os.path.join(corpus.directory, "manifest.json"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


if __name__ == "__main__":
    main()
