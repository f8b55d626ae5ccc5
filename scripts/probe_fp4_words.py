"""The FP4 GEMV's decodes timed on a GPU at Flash dims: "quarter", "fp8" and the word-wise float16 decode ("f16",
at 4 and 2 warps; the kernel joins the stored bytes into words in registers). Every variant's output is checked
against the reference; the script exits 1 when one disagrees. (Session 23's run also timed the codes stored as
32-bit words, no faster, and XLA's view of bytes as words, a copy: docs/benchmarks/fp4_words_h100/; that path is
gone.)

    PYTHONPATH=. python scripts/probe_fp4_words.py --out /tmp/fp4_words   # writes .json and .md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.grouped_matmul_fp4 import gemv, grouped_gemv_fp4, grouped_gemv_fp4_reference

EXPERTS = 256
SHAPES = {"gate_up": (4096, 2048, 2), "down": (2048, 4096, 1)}  # k, n, weights


def _weights(rng, k: int, n: int, count: int):
    packed = lambda: jnp.asarray(rng.integers(0, 256, (EXPERTS, k // 2, n), dtype=np.uint8))  # noqa: E731
    scales = lambda: jnp.asarray(rng.integers(118, 128, (EXPERTS, k // 32, n), dtype=np.uint8))  # noqa: E731
    return tuple((packed(), scales()) for _ in range(count))


def _time(fn, *args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output path without extension")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--interpret", action="store_true", help="CPU smoke run: interpret mode, small dims")
    args = ap.parse_args(argv)
    global EXPERTS, SHAPES
    if args.interpret:
        EXPERTS, SHAPES, args.iters = 8, {"gate_up": (256, 256, 2), "down": (256, 256, 1)}, 1
    rng = np.random.default_rng(0)
    base = gemv.GEMV_DEFAULT
    variants = {name: dataclasses.replace(base, **kw) for name, kw in {
        "quarter": dict(decode="quarter"), "fp8": dict(decode="fp8"), "f16": dict(decode="f16"),
        "f16_2_warps": dict(decode="f16", num_warps=2)}.items()}
    records, ok = [], True
    for shape, (k, n, count) in SHAPES.items():
        ws = _weights(rng, k, n, count)
        for selections in ((3, 6) if args.interpret else (6, 48)):
            x = jnp.asarray(rng.standard_normal((selections, k)), jnp.bfloat16)
            group = jnp.asarray(rng.choice(EXPERTS, selections, replace=False), jnp.int32)
            interpret = dict(interpret=True) if args.interpret else {}
            ref = grouped_gemv_fp4_reference(x, ws, group)
            runs = {name: (lambda bs=bs: (grouped_gemv_fp4, (x, ws, group), dict(block_sizes=bs, **interpret)))()
                    for name, bs in variants.items()}
            for name, (fn, fn_args, kw) in runs.items():
                call = jax.jit(lambda *a, fn=fn, kw=kw: fn(*a, **kw))
                got = call(*fn_args)
                err = max(float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r)) for g, r in zip(got, ref))
                good = err < 1e-4
                ok &= good
                us = _time(call, *fn_args, iters=args.iters)
                records.append({"shape": shape, "selections": selections, "case": name, "us": us, "rel_err": err,
                                "ok": good})
                print(json.dumps(records[-1]), flush=True)
    meta = {"device": str(jax.devices()[0]), "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__}
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "records": records}, f, indent=1)
    lines = [f"# FP4 GEMV decodes ({meta['device_kind']}, jax {meta['jax']})", "",
             "Written by `scripts/probe_fp4_words.py`: us per call (mean of a loop of calls), Flash dims, "
             f"{EXPERTS} experts, one row per selection; rel err against the reference.", "",
             "| shape | selections | variant | us | rel err | check |", "|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['shape']} | {r.get('selections', '')} | {r['case']} | {r['us']:.1f} | "
                     f"{r.get('rel_err', float('nan')):.1e} | {'' if 'ok' not in r else 'ok' if r['ok'] else 'FAIL'} |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("PASS" if ok else "FAIL: a variant disagrees with the reference")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
