"""Sharded decode and prefill measured against one device (issue 14), with the sharded logits checked against the
single-device logits in the same run.

    python scripts/bench_mesh.py                 # on a machine with 2 GPUs: writes docs/benchmarks/mesh.md + plot
    python scripts/bench_mesh.py --smoke         # tiny config on 2 forced host CPU devices (CI runs this)

(a) `flash_slice(4)` on one device, expert-parallel over two (EP 2), and data-parallel attention x expert parallel
over two (DP 2: each device serves its own slots and pages; the experts are split over both devices, tokens
exchanged by all-gather + reduce-scatter): decode at batch 1 / 8 / 64 with 2048 tokens of context, prefill chunks
of 2048 and 8192 tokens. (b) the largest `flash_slice(n)` that fits on two devices but not on one, decode and
prefill on two. Reported: per-device memory (peak from the allocator on GPU; the placed bytes on CPU), tokens/s,
the ratio to one device, and the time inside collectives from a profiler trace of the timed steps.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import sys
import tempfile
import time

SMOKE = "--smoke" in sys.argv
if SMOKE and "jax" not in sys.modules:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

import ds4jax  # noqa: E402
from ds4jax.model import params as params_lib  # noqa: E402
from ds4jax.runtime.mesh import make_mesh  # noqa: E402
from ds4jax.runtime.mesh_plan import format_bytes  # noqa: E402
from ds4jax.runtime.mesh_steps import ShardedPoolBook  # noqa: E402
from ds4jax.runtime.pool_spec import PoolSpec, shapes  # noqa: E402
from ds4jax.runtime.pools import KVPool  # noqa: E402
from ds4jax.runtime.roles import Role  # noqa: E402
from ds4jax.runtime.steps import StepBatch  # noqa: E402

COLLECTIVE_NAMES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "nccl")


def layouts(devices):
    one = devices[:1]
    return {
        "1 device": make_mesh(devices=one),
        "EP 2": make_mesh(expert=2, devices=devices),
        "DP 2 x EP": make_mesh(data=2, devices=devices, rules=dp_expert_rules()),
    }


def dp_expert_rules():
    """DP attention with the experts split over the data axis too (no device holds all experts)."""
    from ds4jax.model.sharding import default_rules

    return tuple((k, ("data", "expert")) if k == "experts" else (k, v) for k, v in default_rules())


def place_params(cfg, layout, dtype, seed=0):
    """Random params generated directly in their shards (a 50 GB slice never exists on the host)."""
    shardings = layout.param_shardings(cfg)
    init = jax.jit(lambda key: params_lib.init(cfg, key, dtype), out_shardings=shardings)
    return init(jax.random.key(seed))


def random_pool(spec, steps, seed=0):
    """Host pool arrays with finite random contents, so every layout starts from identical state."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, (shape, dtype) in shapes(spec).items():
        if name in ("page_table", "lengths"):
            continue
        out[name] = (rng.standard_normal(shape, np.float32) * 0.5).astype(jnp.dtype(dtype))
    return out


def place_pool(host, book, runner, spec):
    placed = []
    for s, (sp, sh) in enumerate(zip(runner.stage_specs(spec), runner.pool_shardings(spec))):
        lo, hi = runner.ranges()[s]
        arrays = {}
        for name, (shape, dtype) in shapes(sp).items():
            if name == "page_table":
                value = book.page_table[:, : sp.pages_per_slot]
            elif name == "lengths":
                value = book.lengths.astype(np.int32)
            else:
                value = host[name][_layer_slice(runner.cfg, name, lo, hi)]
            # a zero-size array (the scales of a KV cache without fp8) gets a replicated sharding, as a step returns
            # it (`MeshLayout.sharding`): the timed steps run the program the first step compiled
            arrays[name] = jax.device_put(value, getattr(sh, name))
        placed.append(KVPool(**arrays))
    return tuple(placed)


def _layer_slice(cfg, name, lo, hi):
    from ds4jax.model.config import AttentionType

    if name == "swa_kv":
        return slice(lo, hi)
    kind = AttentionType.HCA if name.startswith("c128") else AttentionType.CSA
    layers = cfg.layers_of(kind)
    return slice(sum(1 for i in layers if i < lo), sum(1 for i in layers if i < hi))


def collective_seconds(trace_dir: str) -> float:
    """Seconds inside collective ops in a jax.profiler trace (device events when there are any)."""
    total = 0.0
    for path in glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True):
        with gzip.open(path) as f:
            events = json.load(f).get("traceEvents", [])
        for e in events:
            name = str(e.get("name", "")).lower()
            if e.get("ph") == "X" and any(c in name for c in COLLECTIVE_NAMES):
                total += float(e.get("dur", 0)) * 1e-6
    return total


def memory(layout, tree) -> int:
    """Peak allocator bytes of the busiest device (GPU), else the placed bytes of `tree` per device (CPU)."""
    stats = [d.memory_stats() or {} for d in layout.mesh.devices.flat]
    peaks = [s.get("peak_bytes_in_use") for s in stats]
    if all(p is not None for p in peaks) and peaks:
        return int(max(peaks))
    return int(max(layout.per_device_bytes(tree).values()))


def run_case(cfg, layout, params, *, rows, chunk, context, steps, dtype, trace):
    """Time `steps` calls (prefill chunk or decode) starting at `context` committed tokens per row."""
    runner = layout.steps(cfg)
    data = layout.axis_sizes["data"]
    spec = PoolSpec.for_role(cfg, role=Role.TARGET, max_slots=max(rows, 2), max_context=context + chunk * (steps + 1),
                             page_size=256 if not SMOKE else 8, dtype=jnp.dtype(dtype).name)
    book = ShardedPoolBook(spec, cfg.vocab_size, 2)  # same page allocation for every layout
    slots = [book.admit() for _ in range(rows)]
    if rows == 1:
        slots = [0]
    for s in slots:
        book.reserve(s, spec.max_context)
        book.lengths[s] = context
    host = random_pool(spec, steps)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg.vocab_size, (steps + 1, rows, chunk)).astype(np.int32)
    order = sorted(range(rows), key=lambda r: slots[r])
    batch_slots = np.array([slots[r] for r in order], np.int32)
    if data > 1 and rows % data:
        return None
    run = runner.decode if chunk == 1 else (lambda *a, **k: runner.prefill(*a, **k, all_logits=False))
    pool = place_pool(host, book, runner, spec)

    def step(i, pool):
        batch = StepBatch(jnp.asarray(batch_slots), jnp.asarray(tokens[i]), jnp.full((rows,), chunk, jnp.int32))
        return run(params, pool, batch, cfg=cfg, spec=spec)

    out, pool = step(0, pool)  # compile + the logits checked against one device
    first = np.asarray(out.logits, np.float32)
    jax.block_until_ready(pool)
    t0 = time.perf_counter()
    ctx = jax.profiler.trace(trace, profiler_options=_trace_options()) if trace else _null()
    with ctx:
        for i in range(1, steps + 1):
            out, pool = step(i, pool)
        jax.block_until_ready((out.logits, pool))
    seconds = time.perf_counter() - t0
    return dict(logits=first, seconds=seconds, tokens_per_s=rows * chunk * steps / seconds,
                memory=memory(layout, (params, pool)), collective_s=collective_seconds(trace) if trace else 0.0)


def _trace_options():
    """The trace without JAX's Python tracer (on by default): `collective_seconds` reads only XLA's op events,
    and recording every Python call of the timed steps slowed them and cost the smoke run a quarter of its CPU."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    return options


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def fits(cfg, devices: int, budget: int, dtype) -> bool:
    total = sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
                for a in jax.tree.leaves(params_lib.abstract(cfg, dtype)))
    return total / devices < 0.8 * budget


def largest_two_only(budget: int, dtype) -> int | None:
    n = None
    for layers in range(1, ds4jax.flash().num_layers + 1):
        cfg = ds4jax.flash_slice(layers)
        if fits(cfg, 2, budget, dtype):
            n = layers if not fits(cfg, 1, budget, dtype) else n
    return n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny config on 2 forced host CPU devices")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per case")
    ap.add_argument("--out", default=None, help="markdown report (default docs/benchmarks/mesh.md; smoke: a temp dir)")
    ap.add_argument("--results", default=None, help="JSON lines, one per finished case (appended)")
    args = ap.parse_args(argv)
    devices = jax.devices()
    if len(devices) < 2:
        raise SystemExit(f"bench_mesh needs 2 devices, found {len(devices)} ({devices[0].platform})")
    dtype = jnp.float32 if SMOKE else jnp.bfloat16
    if SMOKE:
        t = ds4jax.tiny()  # three layers (sliding, CSA, HCA) keep the smoke run's compiles short
        cfg = ds4jax.tiny(num_layers=3, attention_types=t.attention_types[:3], mlp_types=t.mlp_types[:3])
        context, decode_rows, prefill_chunks, steps = 24, (2,), (8,), args.steps or 2
    else:
        cfg, context, decode_rows, prefill_chunks, steps = ds4jax.flash_slice(4), 2048, (1, 8, 64), (2048, 8192), \
            args.steps or 10
    out_dir = tempfile.mkdtemp(prefix="bench_mesh_") if SMOKE and not args.out else None
    out = args.out or (os.path.join(out_dir, "mesh.md") if out_dir else os.path.join("docs", "benchmarks", "mesh.md"))
    results_path = args.results or os.path.splitext(out)[0] + ".jsonl"
    os.makedirs(os.path.dirname(os.path.abspath(results_path)), exist_ok=True)
    done = _finished(results_path)
    rows_out = []
    cases = [("decode", b, 1) for b in decode_rows] + [("prefill", 2, c) for c in prefill_chunks]
    lays = layouts(devices)
    models = {}
    # smoke: the params are generated once, eagerly (leaf by leaf: the small per-shape random programs; one jitted
    # generator of the whole tree was the smoke run's largest compile), and copied into each layout; the real run
    # generates them in place per layout (`place_params`), since its slices do not fit on one host
    host = jax.tree.map(np.asarray, params_lib.init(cfg, jax.random.key(0), dtype)) if SMOKE else None
    for name, layout in tqdm(lays.items(), desc="layouts"):
        models[name] = jax.device_put(host, layout.param_shardings(cfg)) if SMOKE else place_params(cfg, layout, dtype)
        for kind, rows, chunk in tqdm(cases, desc=name, leave=False):
            key = f"{cfg.num_layers}L|{name}|{kind}|{rows}|{chunk}"
            if key in done:  # finished by an earlier (interrupted) run; its logits are not kept, so rerun 1 device
                if name != "1 device":
                    rows_out.append(done[key])
                    continue
            with tempfile.TemporaryDirectory() as trace:
                res = run_case(cfg, layout, models[name], rows=rows, chunk=chunk, context=context, steps=steps,
                               dtype=dtype, trace=trace)
            if res is None:
                continue
            case = (kind, rows, chunk)
            if name == "1 device":
                _REF[case], _SINGLE[case] = res["logits"], res["tokens_per_s"]
            ref = _REF[case]
            err = float(np.abs(res["logits"] - ref).max() / max(np.abs(ref).max(), 1e-30))
            rec = dict(key=key, layers=cfg.num_layers, layout=name, kind=kind, rows=rows, chunk=chunk,
                       tokens_per_s=res["tokens_per_s"], memory=res["memory"], collective_s=res["collective_s"],
                       seconds=res["seconds"], rel_err=err, speedup=res["tokens_per_s"] / _SINGLE[case])
            tol = 1e-5 if dtype == jnp.float32 else 2e-2
            if not err <= tol:
                raise SystemExit(f"{key}: sharded logits differ from one device: rel err {err:.3e} > {tol}")
            rows_out.append(rec)
            with open(results_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        del models[name]
    if not SMOKE:
        budget = (devices[0].memory_stats() or {}).get("bytes_limit", 139 << 30)
        n = largest_two_only(budget, dtype)
        if n:
            big = ds4jax.flash_slice(n)
            layout = lays["EP 2"]
            params = place_params(big, layout, dtype)
            for kind, rows, chunk in (("decode", 8, 1), ("prefill", 2, 2048)):
                with tempfile.TemporaryDirectory() as trace:
                    res = run_case(big, layout, params, rows=rows, chunk=chunk, context=context, steps=steps,
                                   dtype=dtype, trace=trace)
                rec = dict(key=f"{n}L|EP 2|{kind}|{rows}|{chunk}", layers=n, layout="EP 2", kind=kind, rows=rows,
                           chunk=chunk, tokens_per_s=res["tokens_per_s"], memory=res["memory"],
                           collective_s=res["collective_s"], seconds=res["seconds"], rel_err=float("nan"),
                           speedup=float("nan"))
                rows_out.append(rec)
                with open(results_path, "a") as f:
                    f.write(json.dumps(rec) + "\n")
    write_report(out, rows_out, " ".join(["python", "scripts/bench_mesh.py"] + (argv or sys.argv[1:])))
    print(open(out).read())
    return rows_out


_REF: dict = {}
_SINGLE: dict = {}


def _finished(path) -> dict:
    if not os.path.exists(path):
        return {}
    out = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                out[rec["key"]] = rec
    return out


def write_report(path, rows, command):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    lines = [f"# Two-device mesh benchmark\n\nCommand: `{command}` on {jax.devices()[0].device_kind} x "
             f"{len(jax.devices())}.\n",
             "| layers | layout | step | rows | tokens/s | x one device | per-device memory | collectives s | "
             "rel. err vs one device |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        step = "decode" if r["kind"] == "decode" else f"prefill {r['chunk']}"
        lines.append(f"| {r['layers']} | {r['layout']} | {step} | {r['rows']} | {r['tokens_per_s']:.1f} | "
                     f"{r['speedup']:.2f} | {format_bytes(r['memory'])} | {r['collective_s']:.4f} | "
                     f"{r['rel_err']:.2e} |")
    plot = os.path.splitext(path)[0] + "_scaling.png"
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name in dict.fromkeys(r["layout"] for r in rows):
        pts = [r for r in rows if r["layout"] == name and r["kind"] == "decode"]
        ax.plot([r["rows"] for r in pts], [r["tokens_per_s"] for r in pts], marker="o", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("decode batch")
    ax.set_ylabel("tokens / s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(plot, dpi=100)
    lines.append(f"\n![decode tokens/s per layout]({os.path.basename(plot)})\n")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
