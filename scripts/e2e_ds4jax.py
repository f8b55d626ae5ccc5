"""The ds4jax side of `bench_e2e.py` (run in its own process): pooled prefill / decode steps on `flash_slice(n)`
with seeded random bf16 weights; per case the time, the roofline, and for decode a profile of the steps.

Writes PART (JSON, rewritten after every case) and the logits used for the agreement check with HF.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import ds4jax
from ds4jax.model import params as P
from ds4jax.model import layer_stack
from ds4jax.model.handle import Model
from ds4jax.runtime import steps
from ds4jax.runtime.pool_spec import PoolSpec
from ds4jax.runtime.pools import PoolBook, zeros
from ds4jax.runtime.roles import Role

import device_trace
import e2e_common as common


def copy_bandwidth() -> tuple[float, float | None, str | None]:
    """(host-timed, device-timed, why the device-timed one is missing) bytes/s of a 4 GiB read + write. The
    host-timed figure includes the launch and the host round trip; the device-timed one is the kernel's own time
    from a profiler trace, the denominator the roofline fractions use. When the trace fails (no device events, a
    profiler error) the error is returned so the reports can say the fractions fell back to the host-timed figure
    (the H100 runs of round 3 session 11 printed "device-timed" over a host-timed number)."""
    x = jnp.ones((1 << 30,), jnp.float32)  # 4 GiB
    f = jax.jit(lambda a: a * 1.0000001)
    f(x).block_until_ready()
    moved = 2 * x.nbytes
    host = moved / min(common.timed(lambda: f(x), 5))
    try:
        busy = device_trace.profile(lambda: [f(x).block_until_ready() for _ in range(5)], 5, 0)
        return host, moved / (busy["device_busy_ms_per_step"] * 1e-3), None
    except Exception as e:  # no device trace: the host figure stands alone, and the reports say so
        return host, None, f"{type(e).__name__}: {e}"[:300]


# Pallas vs reference agreement per case (both ds4jax, bf16, same rounding points: only the accumulation order
# differs), every row of every batch size. A fast wrong kernel fails here even where HF is not run.
SELF_CHECK_MIN_COSINE = 0.99  # bf16 smoke config: worst row 0.9954; a wrong kernel gives ~0


def agreement(got, ref) -> dict:
    """Row-wise comparison of [rows, vocab] logits: the worst cosine, argmax agreement and pass."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    finite = bool(np.isfinite(got).all() and np.isfinite(ref).all())
    cos = (got * ref).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(ref, axis=-1))
    worst = float(np.nanmin(cos)) if finite else float("nan")
    return {"rows": int(got.shape[0]), "min_cosine": worst, "threshold": SELF_CHECK_MIN_COSINE,
            "argmax_equal_rows": int((got.argmax(-1) == ref.argmax(-1)).sum()), "finite": finite,
            "pass": finite and worst >= SELF_CHECK_MIN_COSINE}


def matmul_flops() -> float:
    a = jnp.ones((8192, 8192), jnp.bfloat16)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    return 2 * 8192**3 / min(common.timed(lambda: f(a), 5))


class Bench:
    def __init__(self, model: Model, kernels: str, max_context: int, max_slots: int):
        self.model, self.kernels = model, kernels
        self.spec = PoolSpec.for_role(model.config, role=Role.TARGET, max_slots=max_slots, max_context=max_context,
                                      dtype="bfloat16")

    def fresh(self, rows: int, length: int):
        book = PoolBook(self.spec, self.model.config.vocab_size)
        for r in range(rows):
            book.admit(r)
            book.reserve(r, length)
        return book, book.sync(zeros(self.spec))

    def prefill(self, rows: int, seq: int, chunk: int, kernels: str | None = None):
        cfg = self.model.config
        ids = common.prompt_ids(rows, seq, cfg.vocab_size)
        kernels = kernels or self.kernels

        def run():
            book, pool = self.fresh(rows, seq + 64)
            out = None
            for s in range(0, seq, chunk):
                tok = ids[:, s : s + chunk]
                n = [tok.shape[1]] * rows
                batch = steps.StepBatch(jnp.arange(rows, dtype=jnp.int32), jnp.asarray(tok), jnp.asarray(n, jnp.int32))
                out, pool = steps.prefill(self.model.params, pool, batch, cfg=cfg, spec=self.spec,
                                          need_logits=s + chunk >= seq, kernels=kernels)
                book.commit(range(rows), n)
            return out.logits, pool

        return run

    def decode_hlo(self, rows: int) -> str:
        """Optimised HLO of the decode step (its ops and their layer name scopes)."""
        cfg = self.model.config
        batch = steps.StepBatch(jnp.zeros((rows,), jnp.int32), jnp.zeros((rows, 1), jnp.int32),
                                jnp.ones((rows,), jnp.int32))
        lowered = steps._target_step.lower(self.model.params, zeros(self.spec), batch, cfg=cfg, spec=self.spec,
                                           role=Role.TARGET, logits=steps.Logits.LAST,
                                           kernels=steps.resolve(self.kernels))
        return lowered.compile().as_text()

    def decode(self, rows: int, ctx: int, new: int, self_check: bool = False):
        """(run: `new` greedy steps at context ctx, rolled back after each run; logits of the first step (row 0);
        with self_check, the first step's logits of every row compared with the reference kernels' step on the same
        pool, else None)."""
        cfg = self.model.config
        logits, pool = self.prefill(rows, ctx, min(ctx, 2048))()
        slots = jnp.arange(rows, dtype=jnp.int32)
        ones = jnp.ones((rows,), jnp.int32)
        step = lambda pool, tok, kernels=self.kernels: steps.decode(  # noqa: E731
            self.model.params, pool, steps.StepBatch(slots, tok, ones), cfg=cfg, spec=self.spec, kernels=kernels)
        first_token = jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None]
        check = None
        if self_check:  # the step donates its pool: the reference step gets a copy
            ref, _ = step(jax.tree.map(jnp.copy, pool), first_token, "reference")
            ref = np.asarray(ref.logits, np.float32)
        out, pool = step(pool, first_token)
        if self_check:
            check = agreement(out.logits, ref)
            del ref
        first = np.asarray(out.logits[0], np.float32)
        self.last_check = check
        state = {"pool": pool.replace(lengths=pool.lengths - 1), "logits": logits}

        def run(n=new):
            pool, logits = state["pool"], state["logits"]
            for _ in range(n):
                out, pool = step(pool, jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None])
                logits = out.logits
            state["pool"] = pool.replace(lengths=pool.lengths - n)  # every run decodes at the same context
            return logits

        return run, first, int(first_token[0, 0])

    def decode_looped(self, rows: int, ctx: int, steps_per_call: int = 8):
        """Greedy decode as the engine runs it: `steps_per_call` steps inside one compiled loop (one host round
        trip per call, the pool donated). Returns run(calls) -> last logits; every run starts at context ctx."""
        cfg, spec, kernels = self.model.config, self.spec, steps.resolve(self.kernels)
        logits, pool = self.prefill(rows, ctx, min(ctx, 2048))()
        batch = lambda tok: steps.StepBatch(jnp.arange(rows, dtype=jnp.int32), tok,  # noqa: E731
                                            jnp.ones((rows,), jnp.int32))

        @functools.partial(jax.jit, donate_argnums=(1,))
        def loop(params, pool, logits):
            def body(_, carry):
                pool, logits = carry
                tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None]
                out, pool = steps._step(params, pool, batch(tok), None, cfg=cfg, spec=spec, role=Role.TARGET,
                                        logits=steps.Logits.LAST, kernels=kernels)
                return pool, out.logits

            pool, logits = jax.lax.fori_loop(0, steps_per_call, body, (pool, logits))
            return pool.replace(lengths=pool.lengths - steps_per_call), logits  # the next call decodes at ctx again

        state = {"pool": pool, "logits": logits}

        def run(calls=1):
            for _ in range(calls):
                state["pool"], out = loop(self.model.params, state["pool"], state["logits"])
            return out

        return run


def looped_timing(bench: Bench, case, need: float, bw: float) -> dict:
    """The engine's way of decoding: 8 steps per compiled call (`Bench.decode_looped`), timed as ms per step and
    the fraction of the roofline (`need` bytes a step at `bw`); a failure is recorded as `loop_error`."""
    try:
        looped = bench.decode_looped(case.rows, case.size)
        looped()
        calls = max(case.new // 8, 1)
        secs = statistics.median(common.timed(lambda: looped(calls), 3)) / (8 * calls)
        return {"ms_per_step_loop": secs * 1e3, "fraction_of_roofline_loop": need / bw / secs}
    except Exception as e:
        return {"loop_error": f"{type(e).__name__}: {e}"[:300]}


def main(args) -> int:
    cfg = ds4jax.tiny() if args.smoke else ds4jax.flash_slice(args.layers)
    t = time.perf_counter()
    # built in the layout the Model keeps (stacked inside the jit, or per layer under DS4JAX_SCAN_LAYERS=0): a Model
    # built from the other layout would copy every weight, doubling memory
    layout = layer_stack.stacked_params if layer_stack.scan_by_default() else (lambda cfg, p: p)
    params = jax.jit(lambda k: layout(cfg, P.init(cfg, k, jnp.bfloat16)))(jax.random.key(common.SEED))
    jax.block_until_ready(params)
    model = Model(cfg, params)
    gpu = jax.default_backend() != "cpu"
    host_bw, device_bw, device_bw_error = copy_bandwidth() if gpu else (None, None, None)
    res = {"side": "ds4jax", "label": args.label, "device": str(jax.devices()[0]), "jax": jax.__version__,
           "kernels": args.kernels, "moe": os.environ.get("DS4JAX_MOE", "auto"),
           "params_b": P.count(params) / 1e9, "init_s": time.perf_counter() - t,
           # the roofline fractions divide by the device-timed copy bandwidth (host-timed kept for comparison)
           "copy_bandwidth_tb_s": (device_bw or host_bw) / 1e12 if gpu else None,
           "copy_bandwidth_host_timed_tb_s": host_bw / 1e12 if gpu else None,
           "copy_bandwidth_device_timed_tb_s": device_bw / 1e12 if device_bw else None,
           "copy_bandwidth_device_timed_error": device_bw_error,
           "matmul_tflop_s": matmul_flops() / 1e12 if gpu else None, "cases": {}}
    self_check = args.kernels != "reference"
    print(json.dumps({k: v for k, v in res.items() if k != "cases"}), flush=True)
    bench = Bench(model, args.kernels, max_context=common.max_context(args) + 256, max_slots=8)
    pb, active = common.param_bytes(cfg, params), common.active_params(cfg, params)
    bw = (res["copy_bandwidth_tb_s"] or 1.0) * 1e12
    peak = (res["matmul_tflop_s"] or 1.0) * 1e12
    for case in common.cases(args):
        if case.name in args.skip or case.hf_only:
            continue
        try:
            t = time.perf_counter()
            if case.kind == "prefill":
                fn = bench.prefill(case.rows, case.size, case.chunk)
                logits, _ = fn()
                jax.block_until_ready(logits)
                if case.name == common.CHECK_CASE:
                    np.save(os.path.join(args.part_dir, f"check_prefill_{args.label}.npy"),
                            np.asarray(logits[0], np.float32))
                compile_s = time.perf_counter() - t
                if self_check:  # every row against the reference kernels (untimed, after the timed compile)
                    ref, _ = bench.prefill(case.rows, case.size, case.chunk, kernels="reference")()
                    check = agreement(logits, ref)
                    del ref
                secs = statistics.median(common.timed(fn, 3))
                nbytes, flops = common.prefill_cost(cfg, pb, active, case.rows, case.size)
                floor = max(nbytes / bw, flops / peak)
                r = {"seconds": secs, "tokens_per_s": case.rows * case.size / secs, "compile_s": compile_s,
                     "weight_bytes": nbytes, "flops": flops, "roofline_ms": floor * 1e3,
                     "roofline_bound": "weights" if nbytes / bw >= flops / peak else "flops",
                     "fraction_of_roofline": floor / secs}
                if self_check:
                    r["self_check"] = check
            else:
                fn, first, token = bench.decode(case.rows, case.size, case.new, self_check=self_check)
                if case.name == common.CHECK_DECODE:
                    np.save(os.path.join(args.part_dir, f"check_decode_{args.label}.npy"), first)
                    r0 = {"check_token": token}
                else:
                    r0 = {}
                fn()
                compile_s = time.perf_counter() - t
                secs = statistics.median(common.timed(fn, 3)) / case.new
                need = common.decode_bytes(cfg, pb, case.rows, case.size)
                r = {"ms_per_step": secs * 1e3, "tokens_per_s": case.rows / secs, "compile_s": compile_s,
                     "bytes_per_step": need, "roofline_ms": need / bw * 1e3, "fraction_of_roofline": need / bw / secs,
                     **r0}
                if self_check:
                    r["self_check"] = bench.last_check
                r.update(looped_timing(bench, case, need, bw))
                if gpu:
                    r["profile"] = device_trace.profile(lambda: jax.block_until_ready(fn(8)), 8, cfg.num_layers)
                if case.name == common.CHECK_DECODE and hasattr(steps, "_target_step"):
                    try:  # one more compile of the decode step, for its HLO
                        hlo = bench.decode_hlo(case.rows)
                        r["hlo_launches"] = device_trace.launches_per_layer(hlo)
                        with open(os.path.join(args.part_dir, f"decode_hlo_{args.label}.txt"), "w") as f:
                            f.write(hlo)  # the compiled decode step, to find copies and fusion boundaries
                    except Exception as e:
                        r["hlo_launches"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        except Exception as e:  # a failed case is recorded; the others still run
            r = {"error": f"{type(e).__name__}: {e}"[:1500], "trace": traceback.format_exc()[-2500:]}
        res["cases"][case.name] = r
        print(case.name, json.dumps(r)[:400], flush=True)
        common.write_json(args.part, res)
    return 0
