"""Logit error of ``numerics="official"`` against the reference path, recipe by recipe (issue 26 item 3).

Models: the trained default model (`ds4jax.default_model()`, prompts = rows of checkpoints/default/heldout_eval.npy)
and the seeded tiny random model (`tiny()`, random ids). Each variant is the full forward (float32 compute unless
named) compared with the reference float32 forward at every position: max |error| / max |logit| per position,
cosine, top-1 agreement, KL(reference || variant), and for the trained model the held-out next-token loss.
Variants switch the official recipes on one at a time (the others patched to identity) and all together; the
reference path in bfloat16 puts the numbers next to plain bf16 compute noise.

    PYTHONPATH=. JAX_PLATFORMS=cpu python scripts/measure_official_numerics.py [--rows 8] [--tokens 256]

writes docs/benchmarks/official_numerics.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.io.default_model import default_checkpoint, default_model
from ds4jax.model import forward as F
from ds4jax.model import official_numerics as on
from ds4jax.model import params as P
from ds4jax.model.config import tiny
from ds4jax.model.handle import Model

RECIPES = {"kv": "round_kv", "indexer": "round_index", "activations": "round_act"}
OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "benchmarks")


@contextlib.contextmanager
def only(keep: tuple[str, ...]):
    """Official recipes not in `keep` patched to identity (the model calls them through the module)."""
    saved = {name: getattr(on, name) for name in RECIPES.values()}
    try:
        for key, name in RECIPES.items():
            if key not in keep:
                setattr(on, name, lambda x, cfg: x)
        yield
    finally:
        for name, f in saved.items():
            setattr(on, name, f)


def logits(model: Model, ids: np.ndarray) -> np.ndarray:
    cfg = model.config
    fn = jax.jit(lambda p, t: F.forward(cfg, p, t))  # a fresh function: traced under the current patches
    return np.concatenate([np.asarray(fn(model.params, jnp.asarray(ids[i:i + 4]))) for i in range(0, len(ids), 4)])


def metrics(got: np.ndarray, want: np.ndarray, ids: np.ndarray | None) -> dict:
    g, w = got.reshape(-1, got.shape[-1]).astype(np.float64), want.reshape(-1, want.shape[-1]).astype(np.float64)
    rel = np.abs(g - w).max(-1) / np.abs(w).max(-1)
    cos = (g * w).sum(-1) / np.linalg.norm(g, axis=-1) / np.linalg.norm(w, axis=-1)
    lw, lg = w - np.logaddexp.reduce(w, -1, keepdims=True), g - np.logaddexp.reduce(g, -1, keepdims=True)
    out = {"rel_err_median": float(np.median(rel)), "rel_err_p99": float(np.percentile(rel, 99)),
           "rel_err_max": float(rel.max()), "cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()),
           "top1_agreement": float((g.argmax(-1) == w.argmax(-1)).mean()),
           "kl_mean_nats": float((np.exp(lw) * (lw - lg)).sum(-1).mean())}
    if ids is not None:  # next-token loss of the variant on the held-out rows
        lp = lg.reshape(got.shape)[:, :-1]
        out["heldout_loss"] = float(-np.take_along_axis(lp, ids[:, 1:, None], -1).mean())
    return out


def measure(name: str, make, ids: np.ndarray, loss: bool) -> dict:
    """`make(dtype)` -> the model with that compute dtype (reference numerics)."""
    f32, bf16 = make(jnp.float32), make(jnp.bfloat16)
    t0 = time.perf_counter()
    want = logits(f32, ids)
    kept = ids if loss else None
    rows = {"reference, bfloat16 compute": metrics(logits(bf16, ids), want, kept)}
    for key in (*RECIPES, "all"):
        with only(tuple(RECIPES) if key == "all" else (key,)):
            rows[f"official: {key}"] = metrics(logits(f32.with_numerics("official"), ids), want, kept)
    rows["official: all, bfloat16 compute"] = metrics(logits(bf16.with_numerics("official"), ids), want, kept)
    if loss:
        rows["reference, float32 (the baseline)"] = metrics(want, want, ids)
    print(f"{name}: {time.perf_counter() - t0:.0f} s")
    return {"model": name, "prompts": list(ids.shape), "variants": rows}


def markdown(result: dict) -> str:
    lines = ["# `numerics=\"official\"` vs the reference path: logit error", "",
             f"One run of `scripts/measure_official_numerics.py` on {result['host']} (CPU, JAX {result['jax']}).",
             "Every variant is the full forward compared with the reference path in float32 at every position; "
             "`rel err` = max |error| / max |logit| per position. Variants switch one official recipe on "
             "(`kv`: FP8 of the K=V rows and main compressed entries, `indexer`: Hadamard + FP4 of the indexer "
             "queries and keys, `activations`: FP8 of the FP8/FP4 GEMMs' inputs) or all of them; the bfloat16 rows "
             "cast the weights and compute in bfloat16. Method and what is left out: docs/official_numerics.md.", ""]
    for m in result["models"]:
        loss = "heldout_loss" in next(iter(m["variants"].values()))
        lines += [f"## {m['model']} ({m['prompts'][0]} prompts x {m['prompts'][1]} tokens)", "",
                  "| variant | rel err median | p99 | max | cosine mean | min | top-1 agree | KL nats |"
                  + (" held-out loss |" if loss else ""),
                  "|---|---|---|---|---|---|---|---|" + ("---|" if loss else "")]
        for v, r in m["variants"].items():
            lines.append(f"| {v} | {r['rel_err_median']:.2e} | {r['rel_err_p99']:.2e} | {r['rel_err_max']:.2e} | "
                         f"{r['cosine_mean']:.5f} | {r['cosine_min']:.4f} | {r['top1_agreement']:.3f} | "
                         f"{r['kl_mean_nats']:.2e} |" + (f" {r['heldout_loss']:.4f} |" if loss else ""))
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=8, help="held-out rows of the default model")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per row")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    heldout = np.load(os.path.join(default_checkpoint(), "heldout_eval.npy")).astype(np.int32)
    trained = measure("trained default model", default_model, heldout[:args.rows, :args.tokens], loss=True)
    cfg = tiny()
    weights = jax.jit(P.init, static_argnums=0)(cfg, jax.random.key(0))
    rand = lambda dtype: Model(config=cfg, params=jax.tree.map(lambda w, t: w.astype(t.dtype), weights,
                                                                P.abstract(cfg, dtype)))
    rand_ids = np.random.default_rng(1).integers(3, cfg.vocab_size, (8, 64)).astype(np.int32)
    random_ = measure("tiny random model (tiny(), seed 0)", rand, rand_ids, loss=False)
    result = {"host": platform.machine(), "jax": jax.__version__, "models": [trained, random_]}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "official_numerics.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(args.out, "official_numerics.md"), "w") as f:
        f.write(markdown(result) + "\n")
    print(markdown(result))


if __name__ == "__main__":
    main()
