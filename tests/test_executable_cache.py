"""`executable_cache.cached_jit`: same results as jax.jit, loads from disk without tracing, keys on everything."""

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ds4jax.runtime import executable_cache

TRACES = []  # one entry per compile through the cache (jax's own trace cache would hide a second trace)


@executable_cache.cached_jit
@functools.partial(jax.jit, static_argnames="scale", donate_argnums=1)
def _step(x, acc, *, scale):
    return acc + scale * x, jnp.sum(x)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    compile_and_store = executable_cache._compile_and_store

    def counted(jitted, key, args, static):
        TRACES.append(static["scale"])
        return compile_and_store(jitted, key, args, static)

    monkeypatch.setattr(executable_cache, "_compile_and_store", counted)
    executable_cache.enable(str(tmp_path))
    TRACES.clear()
    yield tmp_path
    executable_cache.enable(None)


def entries(cache_dir) -> list:
    """The stored executables, once every background write has finished (`executable_cache.flush`)."""
    executable_cache.flush()
    return sorted(cache_dir.rglob("*.exe"))


def test_off_by_default_is_plain_jit():
    assert not executable_cache.enabled()
    out, total = _step(jnp.ones(3), jnp.zeros(3), scale=2.0)
    np.testing.assert_array_equal(out, [2, 2, 2])
    assert _step.uncached is not None


def test_disk_hit_skips_tracing_and_matches_jit(cache_dir):
    x = jnp.arange(4, dtype=jnp.float32)
    first = _step(x, jnp.ones(4), scale=3.0)
    assert TRACES == [3.0] and len(entries(cache_dir)) == 1
    executable_cache.enable(str(cache_dir))  # a new process: memory empty, disk full
    acc = jnp.ones(4)
    again = _step(x, acc, scale=3.0)
    assert TRACES == [3.0]  # loaded, not compiled
    assert acc.is_deleted()  # donation survives serialization
    plain = _step.uncached(x, jnp.ones(4), scale=3.0)
    for a, b, c in zip(first, again, plain):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_key_covers_static_args_shapes_and_dtypes(cache_dir):
    _step(jnp.ones(4), jnp.ones(4), scale=1.0)
    _step(jnp.ones(4), jnp.ones(4), scale=2.0)
    _step(jnp.ones(5), jnp.ones(5), scale=2.0)
    _step(jnp.ones(5, jnp.bfloat16), jnp.ones(5, jnp.bfloat16), scale=2.0)
    _step(jnp.ones(5, jnp.bfloat16), jnp.ones(5, jnp.bfloat16), scale=2.0)  # in memory
    assert len(TRACES) == 4 and len(entries(cache_dir)) == 4


def test_key_covers_the_trace_context(cache_dir):
    """A context a caller traces under (matmul precision, x64, a default device) is part of the key, as in JAX's
    own jit cache: the same call under another context compiles its own program, never loads the other one."""
    x = jnp.ones(4)
    _step(x, jnp.ones(4), scale=1.0)
    with jax.default_matmul_precision("bfloat16"):  # (the suite's own default is "highest")
        _step(x, jnp.ones(4), scale=1.0)
    with jax.default_device(jax.devices()[-1]):
        _step(x, jnp.ones(4), scale=1.0)
    _step(x, jnp.ones(4), scale=1.0)  # back in the first context: in memory
    assert TRACES == [1.0] * 3 and len(entries(cache_dir)) == 3
    executable_cache.enable(str(cache_dir))  # a new process: each context loads its own entry from disk
    with jax.default_matmul_precision("bfloat16"):
        _step(x, jnp.ones(4), scale=1.0)
    assert TRACES == [1.0] * 3


def test_a_context_without_a_stable_name_runs_uncached(cache_dir, monkeypatch):
    class Opaque:  # its repr names an address: no two processes would agree on it
        pass

    monkeypatch.setattr(executable_cache, "_trace_context", lambda: (Opaque(),))
    out, _ = _step(jnp.ones(2), jnp.ones(2), scale=1.0)
    np.testing.assert_array_equal(out, [2, 2])
    assert TRACES == [] and not entries(cache_dir)


def test_corrupt_entry_is_a_miss(cache_dir):
    _step(jnp.ones(2), jnp.ones(2), scale=1.0)
    (entry,) = entries(cache_dir)
    entry.write_bytes(b"not an executable")
    executable_cache.enable(str(cache_dir))
    out, _ = _step(jnp.ones(2), jnp.ones(2), scale=1.0)
    np.testing.assert_array_equal(out, [2, 2])
    assert len(TRACES) == 2


def test_fingerprint_covers_environment(monkeypatch):
    before = executable_cache._fingerprint()
    executable_cache._fingerprint.cache_clear()
    monkeypatch.setenv("DS4JAX_KERNELS", "reference")
    try:
        assert executable_cache._fingerprint() != before
    finally:
        executable_cache._fingerprint.cache_clear()


def test_fingerprint_ignores_the_allocator_settings(monkeypatch):
    """The CLI turns preallocation off itself; memory settings change no program, so they change no key."""
    executable_cache._fingerprint.cache_clear()
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    before = executable_cache._fingerprint()
    executable_cache._fingerprint.cache_clear()
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    try:
        assert executable_cache._fingerprint() == before
    finally:
        executable_cache._fingerprint.cache_clear()


def test_generate_through_the_cache_equals_plain_jit(tmp_path):
    from ds4jax.generation.generate import SamplingParams, generate
    from ds4jax.io.tokenizer import ByteTokenizer
    from small_engine import one_layer_model

    # the cheapest model with the real step programs (one layer and its MTP block): every compile here is one of
    # its own (the cache's compiles never come from JAX's cache), and the tiny model's took 4 of them
    model, ids = one_layer_model(), ByteTokenizer().encode("Hello", add_bos=True)
    params = [SamplingParams(max_new_tokens=6), SamplingParams(max_new_tokens=6, temperature=1.0, seed=3)]
    plain = [generate(model, ids, p) for p in params]
    try:
        for _ in range(2):  # compile and store, then load from disk
            executable_cache.enable(str(tmp_path))
            assert [generate(model, ids, p) for p in params] == plain
        # (under the tests' --xla_backend_optimization_level=0, XLA:CPU cannot serialize sort comparators, so
        # the model's steps may run from memory here; the tiny-function tests above cover the disk round trip)
    finally:
        executable_cache.enable(None)


def test_a_warm_up_loads_stored_programs_on_the_pool(cache_dir, monkeypatch):
    """`precompile`'s capture pass does not deserialize a stored program on the calling thread (one after another:
    ~0.9 s each on an H200 host): the job loads it on the pool, beside the others. A stored entry that fails to
    load is compiled by the program's own call, as any miss."""
    from ds4jax.runtime import precompile

    scales = (5.0, 6.0, 7.0)
    x = jnp.arange(3, dtype=jnp.float32)
    for s in scales:
        _step(x, jnp.ones(3), scale=s)
    assert TRACES == list(scales)
    entries(cache_dir)[0].write_bytes(b"corrupt")  # one of the three
    executable_cache.enable(str(cache_dir))  # a new process
    threads, load = [], executable_cache._load
    monkeypatch.setattr(executable_cache, "_load",
                        lambda key: threads.append(threading.current_thread().name) or load(key))
    with precompile.capturing() as jobs:
        for s in scales:
            assert precompile.run_captured(lambda s=s: _step(x, jnp.ones(3), scale=s))
    assert threads == [] and all(j.compile is not None for j in jobs)  # nothing loaded while capturing
    precompile.compile_all(jobs)
    assert len(threads) == 3 and all(t.startswith("ds4jax-compile") for t in threads), threads
    assert TRACES == list(scales)  # two loaded, the corrupt one not compiled on the pool either
    for s in scales:
        np.testing.assert_array_equal(_step(x, jnp.ones(3), scale=s)[0], 1 + s * x)
    assert len(TRACES) == 4 and TRACES[3] in scales  # the corrupt entry's call compiled it


def test_stores_are_written_in_the_background_and_flushed(cache_dir, monkeypatch):
    """A compile returns before its executable is on disk (the write is off a cold run's path to its first call);
    `flush` waits for it, and so does `clear_memory` (what a test's "new process" does first)."""
    release, write = threading.Event(), executable_cache._write
    monkeypatch.setattr(executable_cache, "_write", lambda *a: release.wait(60) and write(*a))
    out, _ = _step(jnp.ones(2), jnp.ones(2), scale=9.0)  # returns while the write waits
    np.testing.assert_array_equal(out, [10, 10])
    assert not list(cache_dir.rglob("*.exe"))
    release.set()
    executable_cache.clear_memory()
    assert len(list(cache_dir.rglob("*.exe"))) == 1
