"""Benchmark the Pallas kernels against their XLA references (jit of `*_reference`) and the HBM roofline.

Decode shapes at Flash dims (one query per request): for batch B and context L,
  sparse_csa: h=64, d=512, na=128 window rows + nb=min(512, L/4) selected compressed rows
  sparse_hca: h=64, d=512, na=128 window rows + nb=L/128 compressed rows (all visible entries)
  indexer:    hi=64, di=128, c=L/4 entries per request, k=512
  sinkhorn:   the mHC projection (m=4, 20 rounds) of B tokens (ctx unused; also a 16384-token prefill), against
              its XLA `fori_loop` reference (`mhc.sinkhorn`): launch-bound, so timed per call, not per byte
  fp4_gate_up, fp4_down, bf16_gate_up, bf16_down: one MoE layer's routed-expert grouped matmuls for B tokens
              (ctx unused; also a 2048-token prefill) x top-6 of 256 experts, hidden 4096, expert width 2048: the
              FP4 kernel (packed E2M1 + E8M0, `grouped_matmul_fp4`) and the bf16 one on the same routing. Weights
              read = the selected experts' bytes. The check is the jnp reference one tile at a time (lax.map: a
              prefill's 448 tiles would gather 15 GB of f32 weights at once); its time is not taken. The FP4
              kernel's first version (BlockSizes dots="group", decode="arith") and the two mixes are in SWEEP
  fp4_gemv_gate_up, fp4_gemv_down: the same at decode batches through `grouped_gemv_fp4` (one row per selection,
              no dot, no tiles; two selections of one expert read it twice, the roofline counts it once)
Roofline: bytes the op must move (gathered rows, queries, indices, output) / bandwidth, both the nominal
4.8 TB/s of an H200 and the bandwidth of a large on-device copy measured here (same timing method).

Timing: device time of the whole jitted op (every kernel it launches), from a profiler trace of
`iters` back-to-back calls that cycle through ROTATE input sets (different queries, index lists and
pool offsets, so repeated calls do not hit rows left in L2 by the previous one): the union of the
GPU kernels' busy intervals / iters. Host dispatch and blocking are excluded (a blocked host-timed
call costs ~100 us here whatever the op). Fallback when no GPU trace is available: wall time of one
jitted call that runs the op on ROTATE input sets, / ROTATE. Both are recorded, with the per-kernel
breakdown of the trace.

Usage (GPU):  python scripts/bench_kernels.py [--quick] [--sweep] [--variants SPEC] [--out docs/benchmarks/kernels]
Smoke (CPU):  python scripts/bench_kernels.py --quick --interpret --out /tmp/kernels
Every config runs inside try/except: a failure is recorded in the JSON/markdown, not fatal.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import glob
import json
import pathlib
import statistics
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout without install

from ds4jax.runtime.routed_experts import sort_into_tiles, tile_rows
from ds4jax.runtime.target import device_target
from pallas_kernels import (
    GroupedMatmulBlockSizes,
    GroupedMatmulFp4BlockSizes,
    IndexerTopkBlockSizes,
    SparseAttentionBlockSizes,
    indexer_topk,
    grouped_matmul,
    gemv_block_sizes,
    grouped_gemv_fp4,
    grouped_matmul_fp4,
    grouped_matmul_fp4_reference,
    grouped_matmul_reference,
    indexer_topk_reference,
    sinkhorn,
    sinkhorn_reference,
    sparse_attention,
    sparse_attention_reference,
)

NOMINAL_BW = 4.8e12  # H200 HBM3e, bytes/s (datasheet)
ROTATE = 4  # input sets cycled through by the timed calls
SWEEP = {  # tile candidates per op (ptxas sm_90, Triton 3.6: no register spills unless noted)
    "sparse": [  # the bf16 default: block_h=32, block_k=64, num_warps=8, num_stages=2, prefetch=0
        SparseAttentionBlockSizes(block_k=32, num_stages=3),
        SparseAttentionBlockSizes(block_h=16, block_k=32, num_warps=4, num_stages=3),
        SparseAttentionBlockSizes(block_k=32, num_stages=1, prefetch=2),  # register prefetch
    ],
    "indexer": [  # the bf16 default: block_c=128, max_split=16384, num_warps=8, num_stages=3, prefetch=0
        IndexerTopkBlockSizes(max_split=8192),
        IndexerTopkBlockSizes(num_warps=16, num_stages=1, prefetch=1),  # register prefetch
        IndexerTopkBlockSizes(max_split=8192, num_warps=16, num_stages=1, prefetch=1),
    ],
    "fp4": [  # the default: dots="tile", one block_j-deep dot per nibble; decode "f16" (64-row tiles: "bits" on AMD)
        GroupedMatmulFp4BlockSizes(dots="group", decode="arith"),  # the first version (16-deep dots, arithmetic)
        GroupedMatmulFp4BlockSizes(dots="group"),
        GroupedMatmulFp4BlockSizes(decode="arith"),
    ],
    "grouped": [  # bf16 prefill tiles (tile_m 64): the default block_n=64, block_k=64, num_warps=4, num_stages=2;
        # wider column blocks re-read each tile's rows fewer times (x is re-read once per column block)
        GroupedMatmulBlockSizes(block_n=128, block_k=32, num_stages=2),  # 40 KB: fits MI300's LDS
        GroupedMatmulBlockSizes(block_n=128, block_k=32, num_warps=8, num_stages=3),  # 60 KB
        GroupedMatmulBlockSizes(block_n=128, block_k=64, num_warps=8, num_stages=2),  # 80 KB: sm90 only
        GroupedMatmulBlockSizes(block_n=256, block_k=32, num_warps=8, num_stages=2),  # 72 KB: sm90 only
        GroupedMatmulBlockSizes(block_n=256, block_k=64, num_warps=8, num_stages=3),  # 216 KB: sm90 only
    ],
    "fp4gemv": [  # the default (gemv_block_sizes): dots="group", block_n=128, k_splits=16, decode "f16" on every
        # target (the FP8-conversion decode before it on sm89+ and gfx950, "quarter" elsewhere)
        GroupedMatmulFp4BlockSizes(),  # the first: 64 packed rows a step, each weight times its own scale
        GroupedMatmulFp4BlockSizes(dots="group"),  # a scale group a step, its scale row once (first decode)
        # the default's tiles with each decode: the first integer one, "quarter", the FP8 conversion
        GroupedMatmulFp4BlockSizes(block_n=128, k_splits=16, dots="group"),
        GroupedMatmulFp4BlockSizes(block_n=128, k_splits=16, dots="group", decode="quarter"),
        GroupedMatmulFp4BlockSizes(block_n=128, k_splits=16, dots="group", decode="fp8"),
        GroupedMatmulFp4BlockSizes(dots="group", block_n=256, num_warps=8, k_splits=8),
        GroupedMatmulFp4BlockSizes(block_n=128, block_j=32),
    ],
}
GROUPED_OPS = ("fp4_gate_up", "fp4_down", "fp4_gemv_gate_up", "fp4_gemv_down", "bf16_gate_up", "bf16_down")
GROUPED_PREFILL_TOKENS = 2048


@dataclasses.dataclass(frozen=True)
class Dims:
    h: int = 64
    d: int = 512
    window: int = 128
    topk: int = 512
    hi: int = 64
    di: int = 128
    dtype: str = "bfloat16"
    hc: int = 4  # mHC streams (Sinkhorn matrices are hc x hc)
    sinkhorn_iters: int = 20
    hidden: int = 4096  # routed experts (Flash): hidden -> expert width, experts, selected per token
    expert_width: int = 2048
    experts: int = 256
    experts_per_token: int = 6


SINKHORN_PREFILL_TOKENS = 16384
TINY = Dims(h=8, d=64, window=16, topk=16, hi=8, di=32, dtype="float32", hidden=64, expert_width=32, experts=8,
            experts_per_token=2)


# ---------------------------------------------------------------------------------------------- timing


def wall_times(fn, args, warmup, iters):
    """Median wall time of one blocked call (includes host dispatch + sync), and the mean of `iters`
    back-to-back calls (hides dispatch only when the device is slower than the host)."""
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


def _gpu_events(log_dir):
    """[(name, start_ns, end_ns)] of the kernels on the device planes of the trace under log_dir.

    Only the per-stream lines (kernels, copies): derived lines ("XLA Modules", "XLA Ops", "Steps")
    would span the gaps between kernels or repeat them.
    """
    paths = glob.glob(str(pathlib.Path(log_dir) / "**" / "*.xplane.pb"), recursive=True)
    if not paths:
        raise RuntimeError("no xplane.pb written")
    data = jax.profiler.ProfileData.from_file(paths[0])
    events, seen = [], []
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        lines = list(plane.lines)
        seen += [f"{plane.name}:{ln.name}" for ln in lines]
        streams = [ln for ln in lines if ln.name.lower().startswith("stream")]
        for line in streams or [ln for ln in lines if "xla" not in ln.name.lower()]:
            events += [(ev.name, ev.start_ns, ev.end_ns) for ev in line.events]
    if not events:
        names = [(p.name, [ln.name for ln in p.lines][:6]) for p in data.planes]
        raise RuntimeError(f"no device events in the trace; planes: {names}"[:600])
    _LINES_SEEN[:] = seen[:12]
    return events


_LINES_SEEN: list = []  # device lines of the last trace (recorded in the JSON for the record)


def _busy_ns(events):
    """Length of the union of the events' intervals (overlaps and duplicate lines counted once)."""
    total, end = 0, None
    for _, a, b in sorted((e for e in events), key=lambda e: e[1]):
        if end is None or a >= end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def device_time(fn, arg_sets, iters):
    """Device busy time of one call (us) from a profiler trace of `iters` calls, and the top kernels."""
    with tempfile.TemporaryDirectory() as log_dir:
        jax.profiler.start_trace(log_dir)
        try:
            outs = [fn(*arg_sets[i % len(arg_sets)]) for i in range(iters)]
            jax.block_until_ready(outs)
        finally:
            jax.profiler.stop_trace()
        events = _gpu_events(log_dir)
    per_kernel = {}
    for name, a, b in events:
        per_kernel[name] = per_kernel.get(name, 0) + (b - a)
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:6]
    return _busy_ns(events) / iters / 1e3, {k[:60]: round(v / iters / 1e3, 2) for k, v in top}


def batched_time(fn, arg_sets, iters):
    """Fallback: wall time of one jitted call that runs fn on every input set, / len(arg_sets)."""
    many = jax.jit(lambda sets: [fn(*a) for a in sets])
    jax.block_until_ready(many(arg_sets))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(many(arg_sets))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6 / len(arg_sets)


def time_op(fn, arg_sets, a):
    """{device_us, breakdown | device_error + batched_us, wall_us, pipelined_us}; 'us' = the best available."""
    for args in arg_sets:  # compile + warm up
        jax.block_until_ready(fn(*args))
    r = {}
    if not a.interpret:
        try:
            r["device_us"], r["breakdown"] = device_time(fn, arg_sets, a.iters * len(arg_sets))
        except Exception as e:  # noqa: BLE001
            r["device_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    if "device_us" not in r:  # the fallback compiles a second program: only when needed
        r["batched_us"] = batched_time(fn, arg_sets, a.iters)
    r["wall_us"], r["pipelined_us"] = wall_times(fn, arg_sets[0], 1, a.iters)
    r["us"] = r["device_us"] if "device_us" in r else r["batched_us"]
    return r


def measure_copy_bandwidth(n_bytes, a):
    """Bytes read + written per second by a large elementwise op, timed like the kernels."""
    xs = [jnp.full((n_bytes // 4,), float(i), jnp.float32) for i in range(2)]
    f = jax.jit(lambda x: x + 1.0)  # reads and writes n_bytes each
    r = time_op(f, [(x,) for x in xs], a)
    return 2 * n_bytes / (r["us"] * 1e-6), r


# ---------------------------------------------------------------------------------------------- inputs


def sinkhorn_inputs(key, dims: Dims, tokens, n_sets):
    """n_sets [tokens, hc, hc] f32 logit sets; bytes = logits read + result written."""
    sets = [(jax.random.normal(k, (tokens, dims.hc, dims.hc), jnp.float32) * 3,)
            for k in jax.random.split(key, n_sets)]
    return sets, 2 * tokens * dims.hc * dims.hc * 4, [tokens, dims.hc, dims.hc]


def sparse_inputs(key, dims: Dims, batch, ctx, hca, n_sets):
    """Decode: request b owns window rows [b*W, (b+1)*W) and compressed rows [b*n_c, (b+1)*n_c) of
    one copy of the pools; input set i reads copy i (HCA, window) or another random subset (CSA)."""
    dt = jnp.dtype(dims.dtype)
    n_c = ctx // 128 if hca else ctx // 4  # compressed entries visible to the newest token
    nb = n_c if hca else min(dims.topk, n_c)
    sets = _sparse_sets(key, dims, batch, n_c, nb, hca, n_sets)
    itemsize = dt.itemsize
    n_bytes = (
        batch * (dims.window + nb) * (dims.d * itemsize + 4)  # gathered rows + their indices
        + 2 * batch * dims.h * dims.d * itemsize
        + dims.h * 4
    )  # q, out, sink
    shape = {"t": batch, "h": dims.h, "d": dims.d, "na": dims.window, "nb": nb}
    return sets, n_bytes, shape


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5, 6))
def _sparse_sets(key, dims, batch, n_c, nb, hca, n_sets):
    """One compiled program per shape (eager op-by-op generation would compile dozens of small ones)."""
    dt = jnp.dtype(dims.dtype)
    copies_b = n_sets if hca else 1  # CSA: random subsets of one large pool already differ per set
    keys = jax.random.split(key, 3 + 3 * n_sets)
    kv_a = jax.random.normal(keys[0], (n_sets * batch * dims.window, dims.d), dt)
    kv_b = jax.random.normal(keys[1], (copies_b * batch * n_c, dims.d), dt)
    sink = jax.random.normal(keys[2], (dims.h,), jnp.float32)
    sets = []
    for i in range(n_sets):
        kq, kp = keys[3 + 3 * i], keys[4 + 3 * i]
        q = jax.random.normal(kq, (batch, dims.h, dims.d), dt)
        base_a = i * batch * dims.window
        idx_a = base_a + jnp.arange(batch)[:, None] * dims.window + jnp.arange(dims.window)[None, :]
        if hca:
            ent = jnp.broadcast_to(jnp.arange(nb), (batch, nb)) + i * batch * n_c
        else:  # CSA: top-k picks a random subset of the request's entries
            ent = jax.vmap(lambda k: jax.random.permutation(k, n_c)[:nb])(jax.random.split(kp, batch))
        idx_b = jnp.arange(batch)[:, None] * n_c + ent
        sets.append((q, kv_a, idx_a.astype(jnp.int32), kv_b, idx_b.astype(jnp.int32), sink))
    return sets


def indexer_inputs(key, dims: Dims, batch, ctx, n_sets):
    """One key pool; each input set has its own queries and its own random page order over the pool."""
    dt = jnp.dtype(dims.dtype)
    c = ctx // 4
    sets = _indexer_sets(key, dims, batch, c, n_sets)
    n_bytes = (
        batch * c * (dims.di * dt.itemsize + 4)  # key rows + the entry->row map
        + batch * dims.hi * (dims.di * dt.itemsize + 4)
        + batch * dims.topk * 4
    )  # q, w, out
    shape = {"t": batch, "hi": dims.hi, "di": dims.di, "c": c, "k": dims.topk}
    return sets, n_bytes, shape


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _indexer_sets(key, dims, batch, c, n_sets):
    dt = jnp.dtype(dims.dtype)
    keys = jax.random.split(key, 1 + 3 * n_sets)
    pool = jax.random.normal(keys[0], (batch * c, dims.di), dt)
    page = min(64, c)
    n_valid = jnp.full((batch,), c, jnp.int32)
    sets = []
    for i in range(n_sets):
        k1, k2, k3 = keys[1 + 3 * i], keys[2 + 3 * i], keys[3 + 3 * i]
        q = jax.random.normal(k1, (batch, dims.hi, dims.di), dt)
        w = jax.random.normal(k2, (batch, dims.hi), jnp.float32) * dims.hi**-0.5
        # Paged entry->row map: pages of 64 entries in a random order over the pool.
        perm = jax.random.permutation(k3, batch * c // page).reshape(batch, c // page)
        key_rows = (perm[:, :, None] * page + jnp.arange(page)[None, None, :]).reshape(batch, c).astype(jnp.int32)
        sets.append((q, w, pool, key_rows, n_valid))
    return sets


def grouped_inputs(key, dims: Dims, op, tokens, n_sets):
    """One set of expert weights (FP4: random packed bytes, every code, at scale bytes 2^-9 .. 2^-3; bf16: normal
    * 0.02) and n_sets routings (top-k of random expert scores per token, sorted into tiles as the model does) with
    their activations [rows, k]. bytes = the selected experts' weight bytes (mean over the sets) + x + outputs."""
    fp4, gate_up, gemv = op.startswith("fp4"), op.endswith("gate_up"), "gemv" in op
    k, n = (dims.hidden, dims.expert_width) if gate_up else (dims.expert_width, dims.hidden)
    n_w = 2 if gate_up else 1
    dt = jnp.dtype(dims.dtype)
    keys = jax.random.split(key, 2 * n_w + 2 * n_sets)
    if fp4:
        ws = tuple((jax.random.bits(keys[2 * i], (dims.experts, k // 2, n), jnp.uint8),
                    jax.random.randint(keys[2 * i + 1], (dims.experts, k // 32, n), 118, 125).astype(jnp.uint8))
                   for i in range(n_w))
        per_expert = k // 2 * n + k // 32 * n
    else:
        ws = tuple((jax.random.normal(keys[i], (dims.experts, k, n), jnp.float32) * 0.02).astype(dt)
                   for i in range(n_w))
        per_expert = k * n * dt.itemsize
    sets, used = [], []
    s = tokens * dims.experts_per_token
    for i in range(n_sets):
        scores = jax.random.uniform(keys[2 * n_w + 2 * i], (tokens, dims.experts))
        experts = jnp.argsort(-scores, axis=1)[:, :dims.experts_per_token].reshape(-1).astype(jnp.int32)
        if gemv:  # one row per selection, the selections' experts as the groups (no tiles)
            tile_group, rows = experts, s
        else:
            _, tile_group = sort_into_tiles(experts, dims.experts, tile_rows(s))
            rows = tile_group.shape[0] * tile_rows(s)
        x = jax.random.normal(keys[2 * n_w + 2 * i + 1], (rows, k), jnp.float32).astype(dt)
        sets.append((x, ws, tile_group))
        used.append(len(set(np.asarray(experts).tolist())))
    rows = sets[0][0].shape[0]
    n_bytes = int(np.mean(used)) * per_expert * n_w + rows * k * dt.itemsize + n_w * rows * n * 4
    shape = {"tokens": tokens, "selections": s, "rows": rows, "tile_m": 1 if gemv else tile_rows(s), "k": k, "n": n,
             "weights": n_w, "experts_used": float(np.mean(used))}
    return sets, n_bytes, shape


@functools.cache
def _tilewise(reference):
    """`reference` (a grouped-matmul spec) one tile at a time (lax.map): memory of one tile's weights, not all."""
    @jax.jit
    def ref(x, ws, tile_group):
        tiles = tile_group.shape[0]
        xt = x.reshape(tiles, x.shape[0] // tiles, x.shape[1])
        out = jax.lax.map(lambda a: reference(a[0], ws, a[1][None]), (xt, tile_group))
        return tuple(o.reshape(x.shape[0], -1) for o in out)
    return ref


def check_grouped(out, ref):
    return check_sparse(jnp.concatenate(out, axis=1), jnp.concatenate(ref, axis=1))


@jax.jit
def _sparse_errors(out, ref):
    out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
    return jnp.max(jnp.abs(out - ref)), jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)


# Pass marks of the comparison with the XLA reference. Attention and Sinkhorn: relative L2 error of the outputs,
# by the inputs' dtype (the H200 run in kernels.json had at most 0.0022 in bf16: 4.5x below the mark). Indexer:
# the selected sets (an exact tie at the k-th score may swap one entry; random normal scores almost never tie).
REL_L2_MAX = {"bfloat16": 1e-2, "float32": 1e-4}
SET_OVERLAP_MIN = 0.99


def check_sparse(out, ref):
    max_abs, rel = _sparse_errors(out, ref)
    mark = REL_L2_MAX["bfloat16" if jnp.dtype(out.dtype) == jnp.bfloat16 else "float32"]
    return {"max_abs_err": float(max_abs), "rel_l2_err": float(rel), "ok": bool(float(rel) <= mark)}


def check_indexer(out, ref):
    out, ref = np.asarray(out), np.asarray(ref)
    overlap = np.mean([len(set(a) & set(b)) / max(1, len(set(b))) for a, b in zip(out, ref, strict=True)])
    return {"exact_match": float(np.mean(out == ref)), "set_overlap": float(overlap),
            "ok": bool(overlap >= SET_OVERLAP_MIN)}


def failed(rec: dict) -> str | None:
    """Why a record fails the run (an error, or a kernel that disagrees with its reference), else None. A case whose
    reference could not run (`ref_error`, e.g. out of memory at long context) is unchecked, reported, not failed."""
    if "error" in rec:
        return rec["error"]
    if rec.get("check", {}).get("ok") is False:
        return "disagrees with the XLA reference: " + ", ".join(
            f"{k}={v:.3g}" for k, v in rec["check"].items() if k != "ok")
    return None


# References: jitted once per static argument (a fresh jax.jit per config would recompile).
_SPARSE_REF = jax.jit(sparse_attention_reference, static_argnames=("scale",))
_INDEXER_REF = jax.jit(indexer_topk_reference, static_argnames=("k",))
_SINKHORN_REF = jax.jit(sinkhorn_reference, static_argnames=("iters", "eps"))


def run_config(op, batch, ctx, dims, a, bandwidth, block_sizes=None, with_ref=True):
    rec = {"op": op, "batch": batch, "ctx": ctx, "block_sizes": short(block_sizes)}
    try:
        key = jax.random.key(batch * 1_000_003 + ctx)
        n_sets = 1 if a.interpret else ROTATE
        if op == "indexer":
            sets, n_bytes, shape = indexer_inputs(key, dims, batch, ctx, n_sets)
            # The ops are jitted already (static tiles): no extra jit, so each program compiles once.
            kern = functools.partial(indexer_topk, k=dims.topk, block_sizes=block_sizes, interpret=a.interpret)
            ref = functools.partial(_INDEXER_REF, k=dims.topk)
            check = check_indexer
        elif op == "sinkhorn":
            sets, n_bytes, shape = sinkhorn_inputs(key, dims, batch, n_sets)
            kern = functools.partial(sinkhorn, iters=dims.sinkhorn_iters, eps=1e-6, block_sizes=block_sizes,
                                     interpret=a.interpret)
            ref = functools.partial(_SINKHORN_REF, iters=dims.sinkhorn_iters, eps=1e-6)
            check = check_sparse
        elif op in GROUPED_OPS:
            sets, n_bytes, shape = grouped_inputs(key, dims, op, batch, n_sets)
            fp4 = op.startswith("fp4")
            if block_sizes is None:  # "default": what the model's dispatch hands it on this device
                arch = None if a.interpret else device_target().arch
                if "gemv" in op:
                    block_sizes = gemv_block_sizes(arch)
                else:
                    tiles = GroupedMatmulFp4BlockSizes if fp4 else GroupedMatmulBlockSizes
                    block_sizes = tiles.get_default(jnp.dtype(dims.dtype), shape["tile_m"], arch=arch)
            kern = functools.partial(grouped_gemv_fp4 if "gemv" in op else grouped_matmul_fp4 if fp4 else
                                     grouped_matmul, block_sizes=block_sizes, interpret=a.interpret)
            ref = _tilewise(grouped_matmul_fp4_reference if fp4 else grouped_matmul_reference)
            check = check_grouped
        else:
            sets, n_bytes, shape = sparse_inputs(key, dims, batch, ctx, op == "sparse_hca", n_sets)
            scale = dims.d**-0.5
            kern = functools.partial(sparse_attention, scale=scale, block_sizes=block_sizes, interpret=a.interpret)
            ref = functools.partial(_SPARSE_REF, scale=scale)
            check = check_sparse
        rec.update(
            shape=shape,
            bytes=n_bytes,
            roofline_nominal_us=n_bytes / NOMINAL_BW * 1e6,
            roofline_measured_us=n_bytes / bandwidth * 1e6,
        )
        tk = time_op(kern, sets, a)
        rec["kernel_us"] = tk.pop("us")
        rec["kernel_timing"] = tk
        rec["kernel_bw_frac"] = rec["roofline_measured_us"] / rec["kernel_us"]
        try:
            if with_ref:  # else only the check
                tr = time_op(ref, sets, a)
                rec["ref_us"] = tr.pop("us")
                rec["ref_timing"] = tr
                rec["speedup_vs_ref"] = rec["ref_us"] / rec["kernel_us"]
            if not a.no_check:
                rec["check"] = check(kern(*sets[-1]), ref(*sets[-1]))
        # The reference may not fit at long context: record it, keep the kernel result.
        except Exception as e:  # noqa: BLE001
            rec["ref_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    # A failing config is recorded, not fatal.
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        rec["traceback"] = traceback.format_exc(limit=3)[-1500:]
    return rec


def short(bs):
    """'default' (None: what the dispatch picks) or the fields that differ from the class's defaults, e.g.
    'block_h=16 num_warps=4' ('class defaults' when none do: for the FP4 GEMV that is not its default)."""
    if bs is None:
        return "default"
    base = type(bs)()
    return (
        " ".join(
            f"{f.name}={getattr(bs, f.name)}"
            for f in dataclasses.fields(bs)
            if getattr(bs, f.name) != getattr(base, f.name)
        )
        or "class defaults"
    )


VARIANT_CLASSES = {"sparse": SparseAttentionBlockSizes, "indexer": IndexerTopkBlockSizes,
                   "fp4": GroupedMatmulFp4BlockSizes, "fp4gemv": GroupedMatmulFp4BlockSizes,
                   "grouped": GroupedMatmulBlockSizes}


def sweep_kind(op):
    """The SWEEP / --variants key of an op (None: it has no tile sweep)."""
    if op == "indexer":
        return "indexer"
    if op.startswith("sparse"):
        return "sparse"
    if op.startswith("bf16"):
        return "grouped"
    return ("fp4gemv" if "gemv" in op else "fp4") if op.startswith("fp4") else None


def parse_variants(spec):
    """'sparse:block_k=64,num_stages=2;indexer:num_warps=16;fp4:dots=group,decode=arith' -> {'sparse': [BlockSizes],
    'indexer': [...], 'fp4': [...]} (a value that is not an integer stays a string)."""
    out = {kind: [] for kind in VARIANT_CLASSES}
    for item in filter(None, (x.strip() for x in (spec or "").split(";"))):
        kind, _, fields = item.partition(":")
        kind = kind if kind in VARIANT_CLASSES else "sparse"
        kw = {}
        for f in filter(None, fields.split(",")):
            name, _, val = f.partition("=")
            val = val.strip()
            kw[name.strip()] = None if val == "None" else int(val) if val.lstrip("-").isdigit() else val
        out[kind].append(VARIANT_CLASSES[kind](**kw))
    return out


def fmt(x, spec=".3g"):
    return "—" if x is None else format(x, spec)


def write_markdown(path, meta, records):
    lines = [
        "# Kernel benchmarks",
        "",
        (
            f"{meta['date']} · jax {meta['jax']} · {meta['device']} · interpret={meta['interpret']} · "
            f"measured copy bandwidth {meta['copy_bandwidth_GBps']:.0f} GB/s (nominal {NOMINAL_BW / 1e9:.0f}) · "
            f"timing: {meta['timing']}"
        ),
        "",
        (
            "| op | batch | ctx | blocks | kernel µs | XLA ref µs | roofline µs (nominal / measured) | "
            "% of measured BW | speedup | kernel wall µs (blocked call) | check | error |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        chk = ", ".join(f"{k}={v:.3g}" for k, v in r.get("check", {}).items() if k != "ok")
        if "check" in r:
            chk = ("ok: " if r["check"].get("ok") else "**FAILED**: ") + chk
        err = r.get("error") or r.get("ref_error") or r.get("kernel_timing", {}).get("device_error") or ""
        lines.append(
            f"| {r['op']} | {r['batch']} | {r['ctx']} | {r['block_sizes']} | {fmt(r.get('kernel_us'))} | "
            f"{fmt(r.get('ref_us'))} | {fmt(r.get('roofline_nominal_us'))} / {fmt(r.get('roofline_measured_us'))} | "
            f"{fmt(100 * r['kernel_bw_frac'] if 'kernel_bw_frac' in r else None, '.0f')} | "
            f"{fmt(r.get('speedup_vs_ref'), '.2f')} | {fmt(r.get('kernel_timing', {}).get('wall_us'))} | "
            f"{chk} | {err[:120]} |"
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
    p.add_argument("--variants", default=None, help="extra tiles, e.g. 'sparse:block_k=64;indexer:num_warps=16'")
    p.add_argument("--no-ref", action="store_true", help="do not time the XLA reference (still checked)")
    p.add_argument("--no-check", action="store_true", help="skip the comparison with the XLA reference")
    p.add_argument("--sweep-at", default=None, help="BATCH:CTX: run the sweep/variants only at this config")
    p.add_argument("--ops", default="sparse_csa,sparse_hca,indexer,sinkhorn")
    p.add_argument("--batches", default=None, help="comma list (default 1,8,64; quick 1,64)")
    p.add_argument("--contexts", default=None, help="comma list (default 8k..512k; quick 8k,128k)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per input set")
    a = p.parse_args(argv)

    dims = TINY if a.interpret else Dims()
    if a.interpret:
        batches, contexts = [1, 2], [512, 2048]
    else:
        batches, contexts = ([1, 64], [8192, 131072]) if a.quick else ([1, 8, 64], [8192, 32768, 131072, 524288])
    batches = [int(x) for x in a.batches.split(",")] if a.batches else batches
    contexts = [int(x) for x in a.contexts.split(",")] if a.contexts else contexts
    a.iters = a.iters or (3 if a.quick else 10)

    bw_bytes = (16 << 20) if a.interpret else (1 << 30)
    bandwidth, bw_timing = measure_copy_bandwidth(bw_bytes, a)
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "device": str(jax.devices()[0].device_kind),
        "backend": jax.default_backend(),
        "interpret": a.interpret,
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "copy_timing": bw_timing,
        "nominal_bandwidth_GBps": NOMINAL_BW / 1e9,
        "iters": a.iters,
        "rotate": ROTATE,
        "timing": (
            "device busy time from a profiler trace"
            if "device_us" in bw_timing
            else f"batched wall time / {ROTATE} ({bw_timing.get('device_error', 'interpret')})"
        ),
        "dims": dataclasses.asdict(dims),
        "trace_lines": list(_LINES_SEEN),
    }
    print(f"[bench] {meta['device']} jax {meta['jax']}: copy bandwidth {bandwidth / 1e9:.0f} GB/s {bw_timing}", flush=True)

    extra = parse_variants(a.variants)
    sweep_at = tuple(int(x) for x in a.sweep_at.split(":")) if a.sweep_at else None
    ops = a.ops.split(",")
    jobs = []  # defaults first (the table), then the tile variants
    for op in ops:
        if op == "sinkhorn":  # per token: no context; decode batches and one prefill chunk
            prefill = 1000 if a.interpret else SINKHORN_PREFILL_TOKENS
            jobs += [(op, tokens, 0, None) for tokens in batches + [prefill]]
            continue
        if op in GROUPED_OPS:  # per token too: decode batches and one prefill chunk (tiles of 64 rows)
            prefill = 200 if a.interpret else GROUPED_PREFILL_TOKENS
            jobs += [(op, tokens, 0, None) for tokens in batches + ([] if "gemv" in op else [prefill])]
            continue
        for batch in batches:
            for ctx in contexts:
                jobs.append((op, batch, ctx, None))
    for op in ops:
        kind = sweep_kind(op)
        if kind is None:  # no tile sweep
            continue
        if op in GROUPED_OPS:
            prefill = 200 if a.interpret else GROUPED_PREFILL_TOKENS
            configs = [sweep_at] if sweep_at else [(b, 0) for b in batches + ([] if "gemv" in op else [prefill])]
        else:
            configs = [sweep_at] if sweep_at else [(b, c) for b in batches for c in contexts]
        for batch, ctx in configs:
            for bs in (SWEEP[kind] if a.sweep else []) + extra[kind]:
                jobs.append((op, batch, ctx, bs))
    out = pathlib.Path(a.out)
    records = []
    for op, batch, ctx, bs in jobs:
        # the grouped ops' reference (tile by tile) is a check, not a baseline: the bf16 kernel is theirs
        with_ref = not a.no_ref and bs is None and op not in GROUPED_OPS
        rec = run_config(op, batch, ctx, dims, a, bandwidth, bs, with_ref=with_ref)
        records.append(rec)
        records.sort(key=lambda r: (ops.index(r["op"]), r["batch"], r["ctx"], r["block_sizes"] != "default"))
        write_outputs(out, meta, records)  # after every config: a killed run keeps its results
        status = rec.get("error") or (
            f"kernel {rec['kernel_us']:.1f} us ({100 * rec['kernel_bw_frac']:.0f}% BW), "
            f"ref {fmt(rec.get('ref_us'))} us, roofline {rec['roofline_measured_us']:.1f} us "
            f"{rec.get('check', '')} {rec['kernel_timing'].get('breakdown', '')} "
            f"{rec['kernel_timing'].get('device_error', '')}"
        )
        print(f"[bench] {op} b={batch} ctx={ctx} {rec['block_sizes']}: {status}", flush=True)

    bad = [(r, why) for r in records if (why := failed(r))]
    unchecked = sum("check" not in r and "error" not in r for r in records)
    print(f"[bench] wrote {out}.json/.md: {len(records)} configs, {len(bad)} failed, {unchecked} unchecked", flush=True)
    for r, why in bad:
        print(f"[bench] FAILED {r['op']} b={r['batch']} ctx={r['ctx']} {r['block_sizes']}: {why[:300]}", flush=True)
    return 1 if bad else 0  # a benchmark that publishes a wrong kernel's number must not look like a success


if __name__ == "__main__":
    sys.exit(main())
