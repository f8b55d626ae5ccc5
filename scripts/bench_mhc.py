"""The hyper-connection pre-step on the GPU: the XLA chain the steps ran before (mixes, the Sinkhorn kernel, the
stream collapse, the RMSNorm: several launches) against the fused `mhc_pre` kernel (after its mixes matmul) at
several tiles, at decode (1 and 8 tokens) and prefill (2048) sizes, Flash dims (m = 4, e = 4096, bf16 streams).
Device time from a profiler trace (`bench_kernels.device_time`); every variant's outputs are checked against
`mhc_pre_reference` first and the script exits 1 if any is off.

    PYTHONPATH=. python scripts/bench_mhc.py --out /tmp/mhc.json [--tokens 1,8,2048]
    PYTHONPATH=. python scripts/bench_mhc.py --interpret --hidden 64 --tokens 2 --variants "fused default"  # CPU
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kernels  # noqa: E402  (scripts/: the device timer)

from ds4jax.model.layers import mhc  # noqa: E402
from ds4jax.model.layers.norms import rms_norm  # noqa: E402
from pallas_kernels import mhc_pre, mhc_pre_reference, sinkhorn  # noqa: E402
from pallas_kernels.mhc_pre import BlockSizes  # noqa: E402

M, E, ITERS, EPS = 4, 4096, 20, 1e-6


def inputs(tokens: int, key, hidden: int = E):
    k = jax.random.split(key, 5)
    n = 2 * M + M * M
    x = jax.random.normal(k[0], (tokens, M, hidden), jnp.float32).astype(jnp.bfloat16)
    p = {"fn": jax.random.normal(k[1], (n, M * hidden)) * (2.0 / np.sqrt(M * hidden)),
         "scale": jax.random.uniform(k[2], (3,), minval=0.5, maxval=2.0), "base": jax.random.normal(k[3], (n,))}
    return x, p, 1.0 + 0.1 * jax.random.normal(k[4], (hidden,))


def chain(x, p, w, *, interpret=False):
    """What the pooled steps ran before the fused kernel: `mhc.hc_weights` with the stand-alone Sinkhorn kernel,
    the collapse, then the RMSNorm (each XLA's own fusions)."""
    mix = mhc._mixes(x, p["fn"], EPS)
    scale, base = p["scale"], p["base"]
    pre = jax.nn.sigmoid(mix[..., :M] * scale[0] + base[:M]) + EPS
    post = 2 * jax.nn.sigmoid(mix[..., M:2 * M] * scale[1] + base[M:2 * M])
    logits = (mix[..., 2 * M:] * scale[2] + base[2 * M:]).reshape(mix.shape[:-1] + (M, M))
    comb = sinkhorn(logits, iters=ITERS, eps=EPS, interpret=interpret)
    collapsed = jnp.sum(pre[..., None] * x.astype(jnp.float32), axis=-2).astype(x.dtype)
    return post, comb, rms_norm(collapsed, w, EPS)


def einsum_mixes(x, fn):
    """The mixes as a plain einsum (one token: XLA's strength-reduced multiply + reduce, no pad, no GEMM)."""
    flat = x.reshape(x.shape[:-2] + (-1,)).astype(jnp.float32)
    return jnp.einsum("...i,io->...o", flat, fn, precision=jax.lax.Precision.HIGHEST)


def fused(x, p, w, *, block_sizes, iters=ITERS, mixes=mhc.raw_mixes, interpret=False):
    return mhc_pre(mixes(x, p["fn"]), x, p["scale"], p["base"], w, iters=iters, hc_eps=EPS, rms_eps=EPS,
                   block_sizes=block_sizes, interpret=interpret)


def variants(interpret: bool = False):
    """name -> fn(x, p, w): the chain before, the fused kernel's default, its mixes variants and a tile sweep."""
    fuse = functools.partial(fused, interpret=interpret)
    out = {"chain (before)": functools.partial(chain, interpret=interpret),
           "fused default": functools.partial(fuse, block_sizes=None),
           "fused default, mixes by einsum": functools.partial(fuse, block_sizes=None, mixes=einsum_mixes)}
    for bt, warps, tile in ((1, 4, 8192), (1, 4, 16384), (1, 8, 16384), (1, 8, 8192), (1, 2, 8192), (1, 2, 16384),
                            (2, 4, 8192), (1, 4, 4096), (4, 4, 16384)):
        bs = BlockSizes(block_tokens=bt, num_warps=warps, tile_elements=tile)
        out[f"fused bt{bt} w{warps} t{tile}"] = functools.partial(fuse, block_sizes=bs)
    out["fused default, 1 Sinkhorn round (its share)"] = functools.partial(fuse, block_sizes=None, iters=1)
    return out


def check(name, got, want) -> str | None:
    """None, or what is wrong: a non-finite output, or one off the reference by more than 1e-4 (the f32 gates and
    comb) / 2e-2 (the bf16 output: a rounding boundary crossed) of its largest magnitude."""
    for g, r in zip(got, want):
        tol = (1e-4 if g.dtype == jnp.float32 else 2e-2) * max(1.0, float(np.abs(np.asarray(r, np.float32)).max()))
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        if not np.isfinite(g).all():
            return f"{name}: non-finite output"
        if np.abs(g - r).max() > tol:
            return f"{name}: max error {np.abs(g - r).max():.3g} > {tol:.3g}"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", default="1,8,2048")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--hidden", type=int, default=E, help="the streams' width e (Flash: 4096)")
    ap.add_argument("--variants", default=None, help="'|'-separated variant names to run (default: all)")
    ap.add_argument("--interpret", action="store_true", help="Pallas interpreter (CPU): checks, times by wall")
    args = ap.parse_args(argv)
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "m": M, "e": args.hidden, "cases": []}
    chosen = {k: v for k, v in variants(args.interpret).items()
              if args.variants is None or k in args.variants.split("|")}
    failures = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        sets = [inputs(tokens, jax.random.key(i), args.hidden) for i in range(2)]
        want = jax.jit(lambda x, p, w: mhc_pre_reference(
            mhc.raw_mixes(x, p["fn"]), x, p["scale"], p["base"], w, iters=ITERS, hc_eps=EPS, rms_eps=EPS))(*sets[0])
        for name, fn in chosen.items():
            f = jax.jit(fn)
            rec = {"tokens": tokens, "variant": name}
            try:
                bad = None if "1 Sinkhorn" in name else check(name, f(*sets[0]), want)
                timing = bench_kernels.time_op(f, sets, args)  # device time from a trace; wall in interpret mode
                key = "device_us" if "device_us" in timing else "batched_us"
                rec.update({key: round(timing[key], 2), "kernels": timing.get("breakdown"), "check": bad or "pass"})
            except Exception as e:  # noqa: BLE001
                bad = rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            failures += [f"{tokens} tokens, {bad}"] if bad else []
            res["cases"].append(rec)
            us = rec.get("device_us", rec.get("batched_us", "-"))
            print(f"{tokens:5d} {name:45s} {us:>9} us  {rec.get('check', rec.get('error'))}", flush=True)
    res["failures"] = failures
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
