"""Benchmark the Pallas kernels against their XLA references (jit of `*_reference`) and the HBM roofline.

Decode shapes at Flash dims (one query per request): for batch B and context L,
  sparse_csa: h=64, d=512, na=128 window rows + nb=min(512, L/4) selected compressed rows
  sparse_hca: h=64, d=512, na=128 window rows + nb=L/128 compressed rows (all visible entries)
  indexer:    hi=64, di=128, c=L/4 entries per request, k=512
Roofline: bytes the op must move (gathered rows, queries, indices, output) / bandwidth, both the nominal
4.8 TB/s of an H200 and the bandwidth of a large on-device copy measured here.

Usage (GPU):  python scripts/bench_kernels.py [--quick] [--sweep] [--out docs/benchmarks/kernels]
Smoke (CPU):  python scripts/bench_kernels.py --quick --interpret --out /tmp/kernels
Every config runs inside try/except: a failure is recorded in the JSON/markdown, not fatal.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import pathlib
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout without install

from pallas_kernels import (
    IndexerTopkBlockSizes,
    SparseAttentionBlockSizes,
    indexer_topk,
    indexer_topk_reference,
    sparse_attention,
    sparse_attention_reference,
)

NOMINAL_BW = 4.8e12  # H200 HBM3e, bytes/s (datasheet)
SWEEP = {  # tile candidates per op (ptxas, sm_90, Triton 3.9: no register spills at these)
    "sparse": [  # the bf16 default is block_h=32, block_k=32, num_warps=8
        SparseAttentionBlockSizes(block_h=16, block_k=32, num_warps=4),
        SparseAttentionBlockSizes(block_h=16, block_k=16, num_warps=4),
    ],
    "indexer": [  # the default is block_c=32, stage=32, num_warps=8
        IndexerTopkBlockSizes(block_c=16, stage=16, num_warps=4),
        IndexerTopkBlockSizes(block_c=16, stage=32, num_warps=8),
    ],
}


@dataclasses.dataclass(frozen=True)
class Dims:
    h: int = 64
    d: int = 512
    window: int = 128
    topk: int = 512
    hi: int = 64
    di: int = 128
    dtype: str = "bfloat16"


TINY = Dims(h=8, d=64, window=16, topk=16, hi=8, di=32, dtype="float32")


def time_fn(fn, args, warmup, iters):
    """Median wall time of one blocked call, and the mean of `iters` back-to-back calls (hides dispatch)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    outs = [fn(*args) for _ in range(iters)]
    jax.block_until_ready(outs)
    return statistics.median(times) * 1e6, (time.perf_counter() - t0) / iters * 1e6


def measure_copy_bandwidth(n_bytes, iters):
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    f = jax.jit(lambda x: x + 1.0)  # reads and writes n_bytes each
    med, _ = time_fn(f, (x,), warmup=2, iters=iters)
    return 2 * n_bytes / (med * 1e-6)


def sparse_inputs(key, dims: Dims, batch, ctx, hca):
    """Decode: request b owns window rows [b*W, (b+1)*W) and compressed rows [b*n_c, (b+1)*n_c)."""
    dt = jnp.dtype(dims.dtype)
    n_c = ctx // 128 if hca else ctx // 4  # compressed entries visible to the newest token
    nb = n_c if hca else min(dims.topk, n_c)
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    q = jax.random.normal(k1, (batch, dims.h, dims.d), dt)
    kv_a = jax.random.normal(k2, (batch * dims.window, dims.d), dt)
    kv_b = jax.random.normal(k3, (batch * n_c, dims.d), dt)
    idx_a = (jnp.arange(batch)[:, None] * dims.window + jnp.arange(dims.window)[None, :]).astype(jnp.int32)
    if hca:
        ent = jnp.broadcast_to(jnp.arange(nb), (batch, nb))
    else:  # CSA: top-k picks a random subset of the request's entries
        ent = jax.vmap(lambda k: jax.random.permutation(k, n_c)[:nb])(jax.random.split(k4, batch))
    idx_b = (jnp.arange(batch)[:, None] * n_c + ent).astype(jnp.int32)
    sink = jax.random.normal(k5, (dims.h,), jnp.float32)
    itemsize = dt.itemsize
    n_bytes = (
        batch * (dims.window + nb) * (dims.d * itemsize + 4)  # gathered rows + their indices
        + 2 * batch * dims.h * dims.d * itemsize
        + dims.h * 4
    )  # q, out, sink
    shape = {"t": batch, "h": dims.h, "d": dims.d, "na": dims.window, "nb": nb}
    return (q, kv_a, idx_a, kv_b, idx_b, sink), n_bytes, shape


def indexer_inputs(key, dims: Dims, batch, ctx):
    dt = jnp.dtype(dims.dtype)
    c = ctx // 4
    k1, k2, k3, k4 = jax.random.split(key, 4)
    q = jax.random.normal(k1, (batch, dims.hi, dims.di), dt)
    w = jax.random.normal(k2, (batch, dims.hi), jnp.float32) * dims.hi**-0.5
    keys = jax.random.normal(k3, (batch * c, dims.di), dt)
    # Paged entry->row map: pages of 64 entries in a random order over the pool.
    page = min(64, c)
    perm = jax.random.permutation(k4, batch * c // page).reshape(batch, c // page)
    key_rows = (perm[:, :, None] * page + jnp.arange(page)[None, None, :]).reshape(batch, c).astype(jnp.int32)
    n_valid = jnp.full((batch,), c, jnp.int32)
    n_bytes = (
        batch * c * (dims.di * dt.itemsize + 4)  # key rows + the entry->row map
        + batch * dims.hi * (dims.di * dt.itemsize + 4)
        + batch * dims.topk * 4
    )  # q, w, out
    shape = {"t": batch, "hi": dims.hi, "di": dims.di, "c": c, "k": dims.topk}
    return (q, w, keys, key_rows, n_valid), n_bytes, shape


def check_sparse(out, ref):
    return {"max_abs_err": float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))}


def check_indexer(out, ref):
    out, ref = np.asarray(out), np.asarray(ref)
    overlap = np.mean([len(set(a) & set(b)) / max(1, len(set(b))) for a, b in zip(out, ref, strict=True)])
    return {"exact_match": float(np.mean(out == ref)), "set_overlap": float(overlap)}


def run_config(op, batch, ctx, dims, args_ns, bandwidth, block_sizes=None):
    rec = {"op": op, "batch": batch, "ctx": ctx, "block_sizes": short(block_sizes)}
    try:
        key = jax.random.key(batch * 1_000_003 + ctx)
        if op == "indexer":
            inputs, n_bytes, shape = indexer_inputs(key, dims, batch, ctx)
            kern = jax.jit(
                functools.partial(indexer_topk, k=dims.topk, block_sizes=block_sizes, interpret=args_ns.interpret)
            )
            ref = jax.jit(functools.partial(indexer_topk_reference, k=dims.topk))
            check = check_indexer
        else:
            inputs, n_bytes, shape = sparse_inputs(key, dims, batch, ctx, hca=(op == "sparse_hca"))
            scale = dims.d**-0.5
            kern = jax.jit(
                functools.partial(sparse_attention, scale=scale, block_sizes=block_sizes, interpret=args_ns.interpret)
            )
            ref = jax.jit(functools.partial(sparse_attention_reference, scale=scale))
            check = check_sparse
        rec.update(
            shape=shape,
            bytes=n_bytes,
            roofline_nominal_us=n_bytes / NOMINAL_BW * 1e6,
            roofline_measured_us=n_bytes / bandwidth * 1e6,
        )
        rec["kernel_us"], rec["kernel_pipelined_us"] = time_fn(kern, inputs, args_ns.warmup, args_ns.iters)
        rec["kernel_bw_frac"] = rec["roofline_measured_us"] / rec["kernel_us"]
        try:
            rec["ref_us"], rec["ref_pipelined_us"] = time_fn(ref, inputs, args_ns.warmup, args_ns.iters)
            rec["speedup_vs_ref"] = rec["ref_us"] / rec["kernel_us"]
            rec["check"] = check(kern(*inputs), ref(*inputs))
        # The reference may not fit at long context: record it, keep the kernel result.
        except Exception as e:  # noqa: BLE001
            rec["ref_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    # A failing config is recorded, not fatal.
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        rec["traceback"] = traceback.format_exc(limit=3)[-1500:]
    return rec


def short(bs):
    """'default' or the non-default fields, e.g. 'block_h=16 num_warps=4'."""
    if bs is None:
        return "default"
    base = type(bs)()
    return (
        " ".join(
            f"{f.name}={getattr(bs, f.name)}"
            for f in dataclasses.fields(bs)
            if getattr(bs, f.name) != getattr(base, f.name)
        )
        or "default"
    )


def fmt(x, spec=".3g"):
    return "—" if x is None else format(x, spec)


def write_markdown(path, meta, records):
    lines = [
        "# Kernel benchmarks",
        "",
        (
            f"{meta['date']} · jax {meta['jax']} · {meta['device']} · interpret={meta['interpret']} · "
            f"measured copy bandwidth {meta['copy_bandwidth_GBps']:.0f} GB/s (nominal {NOMINAL_BW / 1e9:.0f}) · "
            f"median of {meta['iters']} blocked calls"
        ),
        "",
        (
            "| op | batch | ctx | blocks | kernel µs | XLA ref µs | roofline µs (nominal / measured) | "
            "% of measured BW | speedup | check | error |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        chk = ", ".join(f"{k}={v:.3g}" for k, v in r.get("check", {}).items())
        err = r.get("error") or r.get("ref_error") or ""
        lines.append(
            f"| {r['op']} | {r['batch']} | {r['ctx']} | {r['block_sizes']} | {fmt(r.get('kernel_us'))} | "
            f"{fmt(r.get('ref_us'))} | {fmt(r.get('roofline_nominal_us'))} / {fmt(r.get('roofline_measured_us'))} | "
            f"{fmt(100 * r['kernel_bw_frac'] if 'kernel_bw_frac' in r else None, '.0f')} | "
            f"{fmt(r.get('speedup_vs_ref'), '.2f')} | {chk} | {err[:120]} |"
        )
    path.write_text("\n".join(lines) + "\n")


def write_outputs(out, meta, records):
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    write_markdown(out.with_suffix(".md"), meta, records)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/benchmarks/kernels", help="output path without extension (.json, .md)")
    p.add_argument("--quick", action="store_true", help="fewer configs and iterations")
    p.add_argument("--interpret", action="store_true", help="Pallas interpret mode + tiny dims (CPU smoke test)")
    p.add_argument("--sweep", action="store_true", help="also time the SWEEP tile candidates")
    p.add_argument("--ops", default="sparse_csa,sparse_hca,indexer")
    p.add_argument("--batches", default=None, help="comma list (default 1,8,64; quick 1,64)")
    p.add_argument("--contexts", default=None, help="comma list (default 8k..512k; quick 8k,128k)")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args(argv)

    dims = TINY if a.interpret else Dims()
    if a.interpret:
        batches, contexts = [1, 2], [512, 2048]
    else:
        batches, contexts = ([1, 64], [8192, 131072]) if a.quick else ([1, 8, 64], [8192, 32768, 131072, 524288])
    batches = [int(x) for x in a.batches.split(",")] if a.batches else batches
    contexts = [int(x) for x in a.contexts.split(",")] if a.contexts else contexts
    a.iters = a.iters or (3 if a.quick else 20)

    bw_bytes = (16 << 20) if a.interpret else ((512 << 20) if a.quick else (4 << 30))
    bandwidth = measure_copy_bandwidth(bw_bytes, a.iters)
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "device": str(jax.devices()[0].device_kind),
        "backend": jax.default_backend(),
        "interpret": a.interpret,
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "nominal_bandwidth_GBps": NOMINAL_BW / 1e9,
        "iters": a.iters,
        "dims": dataclasses.asdict(dims),
    }
    print(f"[bench] {meta['device']} jax {meta['jax']}: copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)

    out = pathlib.Path(a.out)
    records = []
    for op in a.ops.split(","):
        for batch in batches:
            for ctx in contexts:
                variants = [None] + (SWEEP["indexer" if op == "indexer" else "sparse"] if a.sweep else [])
                for bs in variants:
                    rec = run_config(op, batch, ctx, dims, a, bandwidth, bs)
                    records.append(rec)
                    write_outputs(out, meta, records)  # after every config: a killed run keeps its results
                    status = rec.get("error") or (
                        f"kernel {rec['kernel_us']:.1f} us, ref {fmt(rec.get('ref_us'))} us, "
                        f"roofline {rec['roofline_measured_us']:.1f} us {rec.get('check', '')}"
                    )
                    print(f"[bench] {op} b={batch} ctx={ctx} {rec['block_sizes']}: {status}", flush=True)

    n_err = sum("error" in r for r in records)
    print(f"[bench] wrote {out}.json/.md: {len(records)} configs, {n_err} failed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
