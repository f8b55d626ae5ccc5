"""Compile-time benchmark (issue 22, deliverable 5): what a user waits for before the first token.

Three parts, each a list of records (`--parts compile,engine,cli`):

* ``compile``: seconds to trace + lower and to XLA-compile the target decode (rows x 1 token), prefill (one row,
  a `--chunk`-token chunk) and verify (rows x k+1 tokens, all logits) steps of `ds4jax.flash_slice(n)`, with
  ABSTRACT parameters and pools (ShapeDtypeStructs: no weights are allocated, so the full 43-layer Flash fits any
  machine), AOT ``jax.jit(...).trace().lower().compile()``, per layer layout: ``unrolled`` (one traced body per
  layer, the "before") and ``scanned`` (`layer_stack`: one body per layer kind, the "after"). Every compilation
  cache is off and JAX's in-memory caches are cleared before each program, so each figure is a full compile.
  ``--stages N --stage I`` compiles stage I's step of a layer split into N equal stages instead (its layers as
  `mesh_steps.stage_step` runs them, with its stage-local pools, on one device: the program each stage's devices
  compile, less the sharding), scanned = stacked by stage (`layer_stack.plan_stages`).
* ``engine``: ``Engine(model, max_slots=8, max_context=512).warmup()`` in a NEW process against a fresh on-disk
  cache directory (``DS4JAX_COMPILATION_CACHE``): once cold (empty directory), once cached (a second process),
  for the trained default model and/or `flash_slice(4)` with random bf16 weights (the GPU; ~55 GB of weights).
* ``cli``: ``python -m ds4jax generate --prompt "def fibonacci(n):" --max-new-tokens 64``, cold and cached, time to
  the first byte on stdout and total (`bench_cli_startup.one_run`); the cached run must print what the cold did.

The JSON is rewritten after every record, so a run cut short keeps what finished; `--deadline-s` stops starting
new measurements and marks the rest as errors. Any error (a program that fails to compile, a measurement not
taken) makes the exit status 1: nothing is skipped silently. The markdown tables and the plot are generated from
the JSON (`--render-only` regenerates them, merging several JSON files if given). Progress goes to stderr.

    python scripts/bench_compile.py --layers 2,4,8 --layouts unrolled,scanned --kernels reference \\
        --parts compile --out docs/benchmarks/compile_cpu.json
    python scripts/bench_compile.py --layers 16 --stages 2 --programs decode --kernels reference \
        --parts compile --out docs/benchmarks/compile_stage_cpu.json
    python scripts/bench_compile.py --render-only --out docs/benchmarks/compile.json a.json b.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import traceback

ENV0 = dict(os.environ)  # the caller's environment, for the child processes (which must use their own cache)
# Our measurements must not hit any cache: ds4jax's executable cache and JAX's persistent cache off (set before
# JAX is imported; the in-memory caches are cleared per program below).
# The engine children run this file too: they measure the on-disk cache, so they keep the environment their
# parent gave them (a first GPU run set "off" here in the children as well, and its "cached" warm-ups recompiled).
if "--child-engine" not in sys.argv:
    os.environ["DS4JAX_COMPILATION_CACHE"] = "off"
    os.environ["DS4JAX_EXECUTABLE_CACHE"] = "off"
    os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
# This process only compiles (abstract inputs); on a GPU it must not take 75 % of the memory the engine and CLI
# child processes need (flash_slice(4)'s weights alone are ~55 GB).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PROGRAMS = ("decode", "prefill", "verify")
CLI_ARGV = ["-m", "ds4jax", "generate", "--prompt", "def fibonacci(n):", "--max-new-tokens", "64", "--quiet"]


def log(msg: str) -> None:
    print(f"[bench_compile {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return (head or "unknown") + ("+dirty" if dirty else "")
    except OSError:
        return "unknown"


def environment() -> dict:
    import jax

    import ds4jax  # noqa: F401 (its XLA flags go in before the backend starts; the compiles measured here get them)

    dev = jax.devices()[0]
    return {"backend": jax.default_backend(), "device_kind": dev.device_kind, "jax_version": jax.__version__,
            "commit": commit(), "xla_flags": ENV0.get("XLA_FLAGS", ""), "cpus": os.cpu_count()}


def make_config(name: str, n: int):
    import ds4jax

    if name == "flash_slice":
        return ds4jax.flash_slice(n)
    base = ds4jax.tiny()  # tests: the same schedule slicing as flash_slice, on the tiny config
    return base.replace(num_layers=n, attention_types=base.attention_types[:n], mlp_types=base.mlp_types[:n])


# ---- part 1: AOT compile of one step program ---------------------------------------------------------------------
def abstract_inputs(cfg, layout: str, program: str, args):
    """ShapeDtypeStructs for (params, pool, batch) of `program`, and the step's static arguments."""
    import jax
    import jax.numpy as jnp

    from ds4jax.model import layer_stack
    from ds4jax.model import params as P
    from ds4jax.runtime import pools, steps
    from ds4jax.runtime.pool_spec import PoolSpec
    from ds4jax.runtime.roles import Role

    rows, chunk, logits, k = {"decode": (args.rows, 1, steps.Logits.LAST, 0),
                              "prefill": (1, args.chunk, steps.Logits.LAST, 0),
                              "verify": (args.rows, args.k + 1, steps.Logits.ALL, args.k)}[program]
    spec = PoolSpec.for_role(cfg, role=Role.TARGET, max_slots=args.rows, max_context=args.max_context,
                             draft_tokens=k)
    params = P.abstract(cfg, jnp.dtype(args.dtype))
    if getattr(args, "weights", "bf16") == "published":  # FP8 dense + FP4 experts, as the checkpoint stores them
        from ds4jax.model.quantize import abstract_quantized

        params = abstract_quantized(cfg, params)
    ranges = stage_ranges(cfg, args)
    if layout == "scanned":  # the layout `Model` keeps by default: leaves stacked per segment member (by stage)
        params = {**params, "layers": layer_stack.stack(
            cfg, params["layers"], combine=lambda *xs: jax.ShapeDtypeStruct((len(xs),) + xs[0].shape, xs[0].dtype),
            ranges=ranges)}
    elif layout != "unrolled":
        raise ValueError(f"layout {layout!r}: expected unrolled or scanned")
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    batch = steps.StepBatch(slots=i32(rows), token_ids=i32(rows, chunk), n_tokens=i32(rows))
    x = None
    if ranges is not None:  # one stage's step, as `mesh_steps.MeshSteps` calls it
        from ds4jax.runtime.mesh_steps import stage_config, stage_spec

        s = args.stage % len(ranges)
        lo, hi = ranges[s]
        first, last = s == 0, s == len(ranges) - 1
        keys = (("embed",) if first else ()) + (("hc_head", "norm", "head") if last else ())
        params = {**{k: params[k] for k in keys}, "layers": layer_stack.layer_range(params["layers"], lo, hi)}
        cfg = stage_config(cfg, lo, hi)
        spec, logits = stage_spec(spec, cfg), logits if last else steps.Logits.NONE
        x = None if first else jax.ShapeDtypeStruct((rows, chunk, cfg.hc_mult, cfg.hidden_size), jnp.dtype(args.dtype))
    return (params, pools.abstract(spec), batch, x), dict(cfg=cfg, spec=spec, role=Role.TARGET, logits=logits)


def stage_ranges(cfg, args):
    """The layer ranges of `--stages` equal stages (None: one stage)."""
    if args.stages <= 1:
        return None
    from ds4jax.runtime.mesh import split_ranges

    return split_ranges(args.stages, cfg.num_layers, args.stages)


def bodies(cfg, layout: str, args) -> int:
    """Traced layer bodies in the program (of its stage): one per layer unrolled, one per segment member scanned."""
    from ds4jax.model import layer_stack

    ranges = stage_ranges(cfg, args)
    lo, hi = (0, cfg.num_layers) if ranges is None else ranges[args.stage % len(ranges)]
    return hi - lo if layout == "unrolled" else sum(
        s.period for s in layer_stack.plan_stages(layer_stack.kinds(cfg), ranges) if lo <= s.start < hi)


def compile_seconds(cfg, layout: str, program: str, impl, args) -> dict:
    import jax

    from ds4jax.runtime import steps

    jax.clear_caches()  # inner jits traced by an earlier program would otherwise be reused
    inputs, static = abstract_inputs(cfg, layout, program, args)
    fn = jax.jit(lambda params, pool, batch, x: steps.step(params, pool, batch, x, kernels=impl, **static),
                 donate_argnums=1)  # as the engine's programs: the pool is donated
    c0, t0 = time.process_time(), time.perf_counter()
    lowered = fn.trace(*inputs).lower()
    c1, t1 = time.process_time(), time.perf_counter()
    compiled = lowered.compile()
    c2, t2 = time.process_time(), time.perf_counter()
    text = lowered.as_text()  # untimed: the program's size shows what the scan saved (and that it scans)
    del compiled, lowered
    # process_time counts every thread of the process (XLA compiles on several): on a loaded machine it is the
    # part of the wall time that does not depend on the other processes
    return {"lower_s": t1 - t0, "compile_s": t2 - t1, "seconds": t2 - t0, "cpu_s": c2 - c0, "lower_cpu_s": c1 - c0,
            "stablehlo_kb": round(len(text) / 1024), "while_loops": text.count("stablehlo.while")}


# ---- part 2 and 3: new processes against a tmp on-disk cache ------------------------------------------------------
def child_engine(model_name: str, layout: str) -> None:
    """Runs in the child process: build the model, time `Engine(...).warmup()`, print one JSON line."""
    import jax

    import ds4jax
    from ds4jax import cli

    cli.enable_compilation_cache()  # the CLI's cache setup, DS4JAX_COMPILATION_CACHE = the parent's tmp dir
    t = time.perf_counter()
    if model_name == "default":
        model = ds4jax.default_model()
    elif model_name == "flash_slice4":  # random bf16 weights, drawn in one program (as scripts/bench_engine.py)
        import jax.numpy as jnp

        from ds4jax.model import layer_stack, params as P

        cfg = ds4jax.flash_slice(4)
        model = ds4jax.Model(cfg, jax.jit(lambda k: layer_stack.stacked_params(cfg, P.init(cfg, k, jnp.bfloat16)))(
            jax.random.key(0)))  # stacked inside the jit: no second copy of the weights
    else:
        raise ValueError(f"engine model {model_name!r}: expected default or flash_slice4")
    if layout == "unrolled":
        model = model.unrolled()
    jax.block_until_ready(model.params)
    load_s = time.perf_counter() - t
    t = time.perf_counter()
    engine = ds4jax.Engine(model, max_slots=8, max_context=512)
    engine_s = time.perf_counter() - t
    t = time.perf_counter()
    report = engine.warmup()  # a WarmupReport (an int before the engine reported its programs)
    warmup_s = time.perf_counter() - t
    programs = len(report.programs) if hasattr(report, "programs") else None
    print(json.dumps({"seconds": warmup_s, "load_s": load_s, "engine_s": engine_s, "programs": programs,
                      "compile_threads": getattr(report, "compile_threads", None),
                      "compiles": getattr(report, "compiles", None), "disk_hits": getattr(report, "disk_hits", None),
                      "report": None if isinstance(report, int) else str(report)[:4000],
                      "kernels": engine.kernels.value, "n_layers": model.config.num_layers}), flush=True)


def child_env(cache: str, caches: str = "executables") -> dict:
    """caches: "executables" (JAX's cache and ours, as the CLI sets them up) or "jax" (JAX's alone: the Python API's
    default)."""
    env = {k: v for k, v in ENV0.items() if k not in ("DS4JAX_EXECUTABLE_CACHE", "JAX_COMPILATION_CACHE_DIR")}
    env["DS4JAX_COMPILATION_CACHE"] = cache
    if caches == "jax":
        env["DS4JAX_EXECUTABLE_CACHE"] = "off"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def engine_record(model_name: str, layout: str, phase: str, cache: str, timeout: float,
                  caches: str = "executables") -> dict:
    argv = [sys.executable, os.path.abspath(__file__), "--child-engine", model_name, "--layouts", layout]
    t = time.perf_counter()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=child_env(cache, caches), timeout=timeout,
                              cwd=REPO)
    except subprocess.TimeoutExpired as e:  # the child is killed; keep what it said
        tail = (e.stderr or b"")[-1500:]
        raise RuntimeError(f"{phase} warm-up not finished after {timeout:.0f} s (--deadline-s); child stderr: "
                           f"{tail.decode(errors='replace') if isinstance(tail, bytes) else tail}") from None
    total = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if phase == "cached" and out.get("compiles") and out.get("disk_hits") != out["compiles"]:
        # a cached warm-up that compiled anything is not the figure it claims to be: an error record
        raise RuntimeError(f"cached warm-up: {out['disk_hits']} of {out['compiles']} compilations came from the "
                           f"on-disk cache")
    return {**out, "process_s": total}


def cli_record(phase: str, cache: str, cold_stdout: str | None) -> dict:
    sys.path.insert(0, HERE)
    from bench_cli_startup import one_run  # first byte on stdout, CPU time to it, total

    try:
        r = one_run([sys.executable] + CLI_ARGV, child_env(cache))
    except SystemExit as e:  # one_run exits on a failed command
        raise RuntimeError(str(e)) from None
    if cold_stdout is not None and r["stdout"] != cold_stdout:
        raise RuntimeError(f"the cached run printed {r['stdout']!r}, the cold run {cold_stdout!r}")
    return {"seconds": r["first_byte_s"], **{k: r[k] for k in ("first_byte_s", "first_byte_cpu_s", "total_s",
                                                                "cpu_s", "stdout")}}


# ---- the run --------------------------------------------------------------------------------------------------------
class Run:
    """Records, written to the JSON after each one; `measure` turns an exception into an error record."""

    def __init__(self, path: str, meta: dict, deadline: float | None):
        self.path, self.meta, self.deadline, self.records = path, meta, deadline, []

    def left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def measure(self, base: dict, fn) -> dict:
        rec = {**base, **{k: self.meta[k] for k in ("backend", "device_kind", "jax_version", "commit")}}
        name = " ".join(str(base[k]) for k in ("part", "what", "layout", "caches", "n_layers", "phase") if base.get(k))
        if self.left() is not None and self.left() <= 0:
            rec.update(status="error", error="not run: --deadline-s reached")
            log(f"{name}: NOT RUN (deadline)")
        else:
            log(f"{name} ...")
            try:
                rec.update(fn(), status="ok")
                log(f"{name}: {rec['seconds']:.2f} s")
            except Exception as e:  # noqa: BLE001 (every failure becomes a record, never a silent skip)
                rec.update(status="error", error=f"{type(e).__name__}: {e}"[:4000])
                log(f"{name}: ERROR {rec['error'][:500]}\n{traceback.format_exc()[-2000:]}")
        self.records.append(rec)
        self.save()
        return rec

    def save(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"meta": self.meta, "records": self.records}, f, indent=1)
        os.replace(tmp, self.path)  # a run killed mid-write keeps the previous complete file


def run_parts(args, run: Run) -> None:
    import jax

    from ds4jax.runtime.kernels import resolve

    try:  # JAX_ENABLE_COMPILATION_CACHE above already says so; this is belt and braces
        jax.config.update("jax_enable_compilation_cache", False)
    except (AttributeError, KeyError) as e:
        log(f"jax_enable_compilation_cache: {e}")
    run.meta["jax_compilation_cache_dir"] = jax.config.jax_compilation_cache_dir  # must be None
    impl = resolve(args.kernels)
    meta = run.meta
    if "compile" in args.parts:
        jax.jit(lambda x: x + 1)(1)  # start the backend outside the first measurement
        for program in args.programs:  # the decode step first: the Target's figure
            for n in args.layers:
                for layout in args.layouts:
                    cfg = make_config(args.config, n)
                    base = {"part": "compile", "what": program, "layout": layout, "n_layers": n,
                            "kernels": impl.value, "config": f"{args.config}({n})", "rows": 1 if program ==
                            "prefill" else args.rows, "tokens": {"decode": 1, "prefill": args.chunk,
                                                                 "verify": args.k + 1}[program]}
                    if args.stages > 1:
                        stage = args.stage % args.stages
                        base.update(stages=args.stages, stage=stage,
                                    config=f"{args.config}({n}) stage {stage} of {args.stages}",
                                    stage_layers=list(stage_ranges(cfg, args)[stage]))
                    base["layer_bodies"] = bodies(cfg, layout, args)
                    run.measure(base, lambda: compile_seconds(cfg, layout, program, impl, args))
    if "engine" in args.parts:
        for model_name, layout, caches in itertools.product(args.engine_models, args.engine_layouts,
                                                             args.engine_caches):
            cache = tempfile.mkdtemp(prefix="ds4jax-compile-bench-")
            for phase in ("cold", "cached"):  # cached: a second new process on the cache the cold one filled
                base = {"part": "engine", "what": f"warmup {model_name}", "layout": layout, "phase": phase,
                        "kernels": impl.value, "config": model_name, "max_slots": 8, "max_context": 512,
                        "caches": caches}
                rec = run.measure(base, lambda: engine_record(model_name, layout, phase, cache,
                                                              timeout=_timeout(run), caches=caches))
                if rec.get("n_layers") is None:
                    rec["n_layers"] = 4 if model_name == "flash_slice4" else None
    if "cli" in args.parts:
        cache, cold = tempfile.mkdtemp(prefix="ds4jax-compile-bench-cli-"), None
        for phase in ("cold", "cached"):
            base = {"part": "cli", "what": "generate first token", "layout": "default", "phase": phase,
                    "kernels": "default", "config": "default", "argv": CLI_ARGV}
            rec = run.measure(base, lambda: cli_record(phase, cache, cold))
            cold = rec.get("stdout") if phase == "cold" else cold
            if phase == "cold" and rec["status"] != "ok":
                cold = None
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    run.save()


def _timeout(run: Run) -> float | None:
    left = run.left()
    return None if left is None else max(left, 1.0)


# ---- rendering: markdown tables and the plot, from the JSON ----------------------------------------------------------
def _fmt(x, unit=" s") -> str:
    return "-" if x is None else f"{x:.2f}{unit}"


def render_md(data: dict) -> str:
    recs, meta = data["records"], data["meta"]
    out = [f"# Compile time ({meta.get('backend')}, {meta.get('device_kind')}, jax {meta.get('jax_version')})", "",
           "Generated by `scripts/bench_compile.py` from the JSON next to this file (commit "
           f"`{meta.get('commit')}`, {meta.get('cpus')} CPUs, 1/5/15-minute load average at the start of each "
           f"run: {'; '.join(str(m.get('load_average')) for m in meta.get('runs', [meta]))}).", ""]
    comp = [r for r in recs if r["part"] == "compile"]
    if comp:
        out += ["Compile: AOT `trace().lower()` then `compile()` of one target step of `flash_slice(n)` with "
                "abstract parameters and pools, every compilation cache off; unrolled = one traced body per layer "
                "(before `lax.scan`), scanned = one body per layer kind. `cpu` = CPU time of the process (all threads).", ""]
        staged = sorted({(r["stage"], r["stages"]) for r in comp if r.get("stages")})
        if staged:
            out += ["Layer split: the step of stage " + ", ".join(f"{s} of {n}" for s, n in staged) + " equal "
                    "stages (its layers [lo, hi) in the first column, stage-local pools; scanned = stacked by stage, "
                    "`layer_stack.plan_stages`: a stage whose unit repeats fewer than 3 times stays unrolled).", ""]
    for program in PROGRAMS:
        rows = [r for r in comp if r["what"] == program]
        if not rows:
            continue
        r0 = rows[0]
        out += [f"## {program} ({r0.get('rows')} rows x {r0.get('tokens')} tokens, {r0.get('kernels')} kernels)", "",
                "| layers | unrolled: lower | compile | total | cpu | scanned: lower | compile | total | cpu | "
                "scanned / unrolled | layer bodies traced (unrolled / scanned) |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        by = {(r["layout"], r["n_layers"]): r for r in rows}
        for n in sorted({r["n_layers"] for r in rows}):
            cells = []
            for layout in ("unrolled", "scanned"):
                r = by.get((layout, n))
                if r is None or r["status"] != "ok":
                    cells += ["error" if r else "-"] + ["-"] * 3
                else:
                    cells += [_fmt(r["lower_s"]), _fmt(r["compile_s"]), f"**{_fmt(r['seconds'])}**", _fmt(r["cpu_s"])]
            u, s = by.get(("unrolled", n)), by.get(("scanned", n))
            ratio = (f"{s['seconds'] / u['seconds']:.2f}" if u and s and u["status"] == s["status"] == "ok" else "-")
            nb = "/".join(str(r.get("layer_bodies", "?")) if r else "-" for r in (u, s))
            span = next((f" [{r['stage_layers'][0]}, {r['stage_layers'][1]})" for r in (u, s)
                         if r and r.get("stage_layers")), "")
            out.append(f"| {n}{span} | " + " | ".join(cells) + f" | {ratio} | {nb} |")
        for layout in ("unrolled", "scanned"):  # the Target: 43 layers <= 2x the 4-layer figure
            a, b = by.get((layout, 4)), by.get((layout, max(r["n_layers"] for r in rows)))
            if a and b and b is not a and a["status"] == b["status"] == "ok":
                out.append(f"\n{layout}: {b['n_layers']} layers / 4 layers = **{b['seconds'] / a['seconds']:.2f}x** "
                           f"(CPU time {b['cpu_s'] / a['cpu_s']:.2f}x)")
        out.append("")
    eng = [r for r in recs if r["part"] == "engine"]
    if eng:
        out += ["## Engine warm-up in a new process (`Engine(model, max_slots=8, max_context=512).warmup()`)", "",
                "cold = empty on-disk cache, cached = a second process on the cache the first filled.", "",
                "Caches: jax = JAX's persistent cache alone (the Python API's default), executables = ours too (the "
                "CLI's default, `DS4JAX_EXECUTABLE_CACHE=on` for the API: no tracing or lowering).", "",
                "| model | layout | caches | cache | warmup() | programs | model load | whole process |",
                "|---|---|---|---|---|---|---|---|"]
        for r in eng:
            caches = r.get("caches", "executables")  # (records before the option: the CLI's setup)
            if r["status"] != "ok":
                out.append(f"| {r['config']} | {r['layout']} | {caches} | {r['phase']} | error | | | |")
                continue
            out.append(f"| {r['config']} | {r['layout']} | {caches} | {r['phase']} | **{_fmt(r['seconds'])}** | "
                       f"{r.get('programs')} | {_fmt(r.get('load_s'))} | {_fmt(r.get('process_s'))} |")
        out.append("")
    cli = [r for r in recs if r["part"] == "cli"]
    if cli:
        out += ["## CLI: `python " + shlex.join(cli[0].get("argv", CLI_ARGV)) + "` in a new process", "",
                "| cache | first byte on stdout | CPU time to it | total | CPU |", "|---|---|---|---|---|"]
        for r in cli:
            if r["status"] != "ok":
                out.append(f"| {r['phase']} | error | | | |")
                continue
            out.append(f"| {r['phase']} | **{_fmt(r['first_byte_s'])}** | {_fmt(r['first_byte_cpu_s'])} | "
                       f"{_fmt(r['total_s'])} | {_fmt(r['cpu_s'])} |")
        out.append("")
    errors = [r for r in recs if r["status"] != "ok"]
    if errors:
        out += ["## Errors", ""] + [f"* {r['part']} {r['what']} {r.get('layout', '')} {r.get('n_layers') or ''} "
                                    f"{r.get('phase', '')}: {r['error'][:300]}" for r in errors] + [""]
    return "\n".join(out)


def render_png(data: dict, path: str) -> bool:
    comp = [r for r in data["records"] if r["part"] == "compile" and r["status"] == "ok"]
    programs = [p for p in PROGRAMS if any(r["what"] == p for r in comp)]
    if not programs:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(programs), figsize=(4.5 * len(programs), 3.8), squeeze=False)
    for ax, program in zip(axes[0], programs):
        for layout, marker, color in (("unrolled", "o", "tab:red"), ("scanned", "s", "tab:blue")):
            pts = sorted((r["n_layers"], r["seconds"], r["cpu_s"]) for r in comp
                         if r["what"] == program and r["layout"] == layout)
            if pts:  # wall (trace + lower + compile) and the process' CPU time (the load-independent part)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker + "-", color=color, label=f"{layout}: wall")
                ax.plot([p[0] for p in pts], [p[2] for p in pts], marker + ":", color=color, alpha=0.5,
                        label=f"{layout}: CPU time")
        ax.set_xticks(sorted({r["n_layers"] for r in comp}))
        ax.set_title(program)
        ax.set_xlabel(f"layers ({comp[0]['config'].split('(')[0]})")
        ax.set_ylabel("seconds")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    meta = data["meta"]
    fig.suptitle(f"Compile seconds vs depth, unrolled (before) vs scanned ({meta.get('backend')}, "
                 f"{meta.get('device_kind')}, jax {meta.get('jax_version')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def render(data: dict, json_path: str) -> None:
    stem = os.path.splitext(json_path)[0]
    with open(stem + ".md", "w") as f:
        f.write(render_md(data))
    render_png(data, stem + ".png")
    log(f"wrote {stem}.md" + (f", {stem}.png" if os.path.exists(stem + ".png") else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--parts", default="compile", help="comma list of compile, engine, cli")
    ap.add_argument("--layers", default="2,4,8,16,43", help="flash_slice depths")
    ap.add_argument("--layouts", default="unrolled,scanned")
    ap.add_argument("--programs", default=",".join(PROGRAMS))
    ap.add_argument("--kernels", default=None, help="reference | pallas (default: the backend's, kernels.resolve)")
    ap.add_argument("--config", default="flash_slice", choices=("flash_slice", "tiny"))
    ap.add_argument("--dtype", default="bfloat16", help="parameter dtype of the abstract params")
    ap.add_argument("--rows", type=int, default=8, help="decode / verify rows (= the pool's slots)")
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk tokens (one row)")
    ap.add_argument("--k", type=int, default=3, help="verify scores k+1 positions per row")
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--stages", type=int, default=1, help="compile one stage's step of a split into this many stages")
    ap.add_argument("--stage", type=int, default=-1, help="which stage (with --stages; default: the last)")
    ap.add_argument("--engine-models", default="default,flash_slice4")
    ap.add_argument("--engine-layouts", default="scanned")
    ap.add_argument("--engine-caches", default="executables",
                    help="comma list of executables (JAX's cache and ours, as the CLI) and jax (JAX's alone, the API)")
    ap.add_argument("--deadline-s", type=float, default=None, help="start no measurement after this many seconds")
    ap.add_argument("--out", default="docs/benchmarks/compile.json")
    ap.add_argument("--render-only", nargs="*", metavar="JSON", default=None,
                    help="only regenerate the md and png of --out (from these JSON files merged, if given)")
    ap.add_argument("--child-engine", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name in ("parts", "layouts", "programs", "engine_models", "engine_layouts", "engine_caches"):
        setattr(args, name, [s for s in getattr(args, name).split(",") if s])
    args.layers = [int(n) for n in args.layers.split(",") if n]
    if args.child_engine:
        child_engine(args.child_engine, args.layouts[0])
        return 0
    if args.render_only is not None:
        data = None
        for path in args.render_only or [args.out]:
            with open(path) as f:
                part = json.load(f)
            if data is None:
                data = {"meta": {**part["meta"], "runs": part["meta"].get("runs", [part["meta"]])}, "records": []}
            else:
                data["meta"]["runs"] += part["meta"].get("runs", [part["meta"]])
            data["records"] += part["records"]
        # a measurement re-run in a later file (e.g. one cut by a deadline) supersedes its error record
        key = lambda r: tuple(str(r.get(k)) for k in ("part", "what", "layout", "n_layers", "phase", "kernels",
                                                       "caches", "backend", "device_kind"))
        ok = {key(r) for r in data["records"] if r["status"] == "ok"}
        kept = [r for r in data["records"] if r["status"] == "ok" or key(r) not in ok]
        dropped = len(data["records"]) - len(kept)
        data["meta"]["superseded_errors"] = data["meta"].get("superseded_errors", 0) + dropped
        data["records"] = kept
        if args.render_only:
            with open(args.out, "w") as f:
                json.dump(data, f, indent=1)
        render(data, args.out)
        return 0 if all(r["status"] == "ok" for r in data["records"]) else 1
    deadline = None if args.deadline_s is None else time.monotonic() + args.deadline_s
    meta = {**environment(), "argv": sys.argv[1:] if argv is None else list(argv),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average": [round(x, 1) for x in os.getloadavg()],
            "settings": {k: getattr(args, k) for k in ("rows", "chunk", "k", "max_context", "dtype")}}
    run = Run(args.out, meta, deadline)
    run.save()
    try:
        run_parts(args, run)
    finally:
        run.meta["load_average_end"] = [round(x, 1) for x in os.getloadavg()]
        run.save()
        render({"meta": run.meta, "records": run.records}, args.out)
    bad = [r for r in run.records if r["status"] != "ok"]
    if bad:
        log(f"{len(bad)} of {len(run.records)} records are errors")
    return 1 if bad or not run.records else 0


if __name__ == "__main__":
    sys.exit(main())
