"""runtime/precompile.py: a captured program call is lowered but not run, the pool compiles it, and the real call
afterwards compiles nothing (JAX's own cache, or executable_cache's memory when that cache is on)."""

import functools

import jax
import jax.numpy as jnp
import pytest

from ds4jax.generation import snapshots
from ds4jax.generation.compiles import compile_count
from ds4jax.runtime import executable_cache, precompile
from ds4jax.runtime.executable_cache import cached_jit


def _program(scale: float):
    @cached_jit
    @functools.partial(jax.jit, static_argnames=("k",))
    def f(x, *, k):
        for _ in range(k):
            x = jnp.tanh(x * scale)
        return x

    return f


def _capture_compile_call(f, args):
    ran = []
    with precompile.capturing() as jobs:
        for x in args:
            assert precompile.run_captured(lambda x=x: ran.append(f(x, k=3)))
    assert ran == [] and len(jobs) == len(args)  # lowered, not run
    results = precompile.compile_all(jobs)
    assert all(r is not None and r.totals.compiles >= 1 for r in results)
    before = compile_count()
    outs = [f(x, k=3) for x in args]
    assert compile_count() == before  # the calls found the pool's executables
    return outs


def test_captured_programs_compile_on_the_pool_and_calls_reuse_them(monkeypatch):
    monkeypatch.setenv("DS4JAX_COMPILE_THREADS", "2")
    f = _program(0.5)
    args = [jnp.ones((4, 8)), jnp.ones((2, 3)), jnp.ones((5,))]  # three shapes: three programs
    outs = _capture_compile_call(f, args)
    for x, y in zip(args, outs):
        assert jnp.allclose(y, jnp.tanh(jnp.tanh(jnp.tanh(x * 0.5) * 0.5) * 0.5))


def test_with_the_executable_cache_the_pool_fills_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DS4JAX_COMPILE_THREADS", "2")
    executable_cache.enable(str(tmp_path))
    try:
        f = _program(0.25)
        _capture_compile_call(f, [jnp.ones((3, 3)), jnp.ones((6,))])
        executable_cache.flush()  # the writes run in the background
        assert len(list(tmp_path.rglob("*.exe"))) == 2  # stored for the next process
        executable_cache.clear_memory()
        with precompile.capturing() as jobs:  # a new process: its job loads the stored program, on the pool
            precompile.run_captured(lambda: f(jnp.ones((3, 3)), k=3))
        before = compile_count()
        [loaded] = precompile.compile_all(jobs)
        assert loaded.totals.compiles == 0 and compile_count() == before  # deserialized, not compiled
        x = jnp.ones((3, 3))
        before = compile_count()
        y = f(x, k=3)
        assert compile_count() == before  # the call found what the pool loaded
        assert jnp.allclose(y, jnp.tanh(jnp.tanh(jnp.tanh(x * 0.25) * 0.25) * 0.25))
    finally:
        executable_cache.enable(None)


def test_a_thunk_without_a_program_call_runs_to_the_end():
    with precompile.capturing() as jobs:
        assert not precompile.run_captured(lambda: None)
    assert jobs == [] and precompile.compile_all(jobs) == []
    assert not precompile.active()


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_bad_thread_count_is_named(monkeypatch, value):
    monkeypatch.setenv("DS4JAX_COMPILE_THREADS", value)
    with pytest.raises(ValueError, match="DS4JAX_COMPILE_THREADS"):
        precompile.threads(4)


def test_thread_count_defaults_to_cores_and_programs(monkeypatch):
    monkeypatch.delenv("DS4JAX_COMPILE_THREADS", raising=False)
    assert 1 <= precompile.threads(3) <= 3
    monkeypatch.setenv("DS4JAX_COMPILE_THREADS", "8")
    assert precompile.threads(3) == 3 and precompile.threads(0) == 1


def test_the_engine_warm_up_compiles_the_weights_digest_on_the_pool(monkeypatch):
    """The fingerprint's digest program is one of the pool's jobs (run after the others it stood alone on a cold
    warm-up's critical path), and the warm-up's own fingerprint call then compiles nothing. The small programs
    (snapshot save / load, slot reset) run before the warm-up waits for the pool, and are listed last. The decode
    program is captured before the prefill (its compile is the longest), the report keeps its order."""
    from ds4jax import Engine
    from ds4jax.generation import programs as programs_module
    from small_engine import MAX_CONTEXT, one_layer_model

    names = []
    compile_all = precompile.compile_all

    order = []
    small = programs_module.EngineWarmup._warm_small_programs

    def recording(jobs):
        names.extend(j.name for j in jobs)
        order.append("wait for the pool")
        return compile_all(jobs)

    def small_recording(self, *args):
        order.append("small programs")
        return small(self, *args)

    monkeypatch.setattr(programs_module.precompile, "compile_all", recording)
    monkeypatch.setattr(programs_module.EngineWarmup, "_warm_small_programs", small_recording)
    monkeypatch.setattr(snapshots, "_HOST_DIGEST_BYTES", 0)  # the digest program (small weights: on the host)
    engine = Engine(one_layer_model(seed=5), max_slots=2, max_context=MAX_CONTEXT, prefill_chunk=8,
                    row_buckets=(2,), steps_per_call=2, snapshot_bytes=1 << 20)
    report = engine.warmup()
    assert any(n.endswith("snapshots._digests") for n in names), names
    assert order == ["small programs", "wait for the pool"], order
    # captured (and so compiled) decode first, the longest compile; reported in the warm-up's own order
    programs = [n.rsplit(".", 1)[-1] for n in names]
    assert programs.index("decode_loop") < programs.index("prefill_call"), programs
    assert [p.kind for p in report.programs][:2] == ["prefill", "decode"], report
    assert [p.kind for p in report.programs][-3:] == ["snapshot-save", "snapshot-load", "slot-reset"], report
    [row] = [p for p in report.programs if p.kind == "fingerprint"]
    assert row.compiles >= 1  # counted from the pool's compile (a fresh seed: not in this process yet)
    before = compile_count()
    engine.fingerprint()  # cached on the engine
    assert compile_count() == before


def test_capturing_with_threads_compiles_each_job_while_the_next_is_captured():
    """`capturing(threads=n)`: a job's compile starts when it is captured, not when capture ends (the warm-up's
    Python lowering overlaps the compiles); compile_all waits for those and returns them in order."""
    import threading

    first_compiling = threading.Event()
    order = []

    def compile_first():
        first_compiling.set()
        order.append("first")

    def capture(name, fn):
        precompile.capture(precompile.Job(name, fn))

    with precompile.capturing(threads=2) as jobs:
        assert precompile.run_captured(lambda: capture("first", compile_first))
        assert first_compiling.wait(timeout=60)  # started on the pool while still capturing
        assert precompile.run_captured(lambda: capture("second", lambda: order.append("second")))
        assert precompile.run_captured(lambda: capture("in memory", None))
    results = precompile.compile_all(jobs)
    assert [r.name if r else None for r in results] == ["first", "second", None]
    assert sorted(order) == ["first", "second"]


def test_a_failed_pipelined_job_is_raised_by_compile_all():
    def boom():
        raise RuntimeError("compile failed here")

    with precompile.capturing(threads=1) as jobs:
        precompile.run_captured(lambda: precompile.capture(precompile.Job("bad", boom)))
    with pytest.raises(RuntimeError, match="compile failed here"):
        precompile.compile_all(jobs)


def test_a_call_that_compiles_nothing_reports_the_time_it_ran_in_the_capture_pass(monkeypatch):
    """Small weights' fingerprint runs on the host: it runs to its end in the warm-up's capture pass, and its row
    reports that time (it read 0.00 s when only the second, memoised call was timed)."""
    import time

    from ds4jax import Engine
    from small_engine import MAX_CONTEXT, one_layer_model

    real = snapshots.fingerprint

    def slow(*args):
        time.sleep(0.2)
        return real(*args)

    monkeypatch.setattr(snapshots, "fingerprint", slow)  # the module the engine's snapshots call it through
    engine = Engine(one_layer_model(seed=6), max_slots=2, max_context=MAX_CONTEXT, prefill_chunk=8,
                    row_buckets=(2,), steps_per_call=2, snapshot_bytes=1 << 20)
    [row] = [p for p in engine.warmup().programs if p.kind == "fingerprint"]
    assert row.compiles == 0 and row.seconds >= 0.2, row
