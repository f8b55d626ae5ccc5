"""`executable_cache.prefetch`: a run that announces a tag gets the executables the last run with that tag asked for
first loaded on background threads (the call takes the prefetched one, without loading on its own thread), a
stale hint never hands a call another key's program, the hint follows what the latest run asked for, and a
machine of few cores prefetches only the first program (the rest would compete with the first call's work)."""

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ds4jax.runtime import executable_cache


@executable_cache.cached_jit
@functools.partial(jax.jit, static_argnames="scale")
def _scaled(x, *, scale):
    return scale * x


@pytest.fixture
def loads(tmp_path, monkeypatch):
    """The thread name of every disk load (the prefetch's threads vs the caller's)."""
    seen = []
    load = executable_cache._load

    def recorded(key):
        seen.append(threading.current_thread().name)
        return load(key)

    monkeypatch.setattr(executable_cache, "_load", recorded)
    monkeypatch.setattr(executable_cache, "_cpus", lambda: 16)  # cores to spare: every hinted program prefetched
    executable_cache.enable(str(tmp_path))
    yield seen
    executable_cache.enable(None)


def _new_process(tmp_path):
    executable_cache.enable(str(tmp_path))  # memory, pending loads and the hint forgotten; the disk stays


def test_second_run_takes_its_programs_from_the_prefetch(loads, tmp_path):
    assert executable_cache.prefetch("run") == 0  # nothing recorded yet
    x = jnp.arange(3.0)
    first = [_scaled(x, scale=2.0), _scaled(x, scale=3.0)]
    _new_process(tmp_path)
    before = len(loads)  # the first run's misses
    assert executable_cache.prefetch("run") == 2
    again = [_scaled(x, scale=2.0), _scaled(x, scale=3.0)]
    assert len(loads) == before + 2
    assert all(name.startswith("ds4jax-prefetch") for name in loads[before:]), loads  # none on this thread
    assert not executable_cache._pending
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)


def test_a_stale_hint_never_serves_another_key(loads, tmp_path):
    x = jnp.arange(3.0)
    executable_cache.prefetch("run")
    _scaled(x, scale=2.0)
    _new_process(tmp_path)
    assert executable_cache.prefetch("run") == 1
    np.testing.assert_array_equal(_scaled(x, scale=5.0), 5.0 * x)  # not the prefetched scale=2 program
    np.testing.assert_array_equal(_scaled(jnp.arange(4.0), scale=2.0), 2.0 * jnp.arange(4.0))  # nor another shape
    # the hint now names what this run asked for first
    _new_process(tmp_path)
    before = len(loads)
    assert executable_cache.prefetch("run") == 2
    np.testing.assert_array_equal(_scaled(x, scale=5.0), 5.0 * x)
    np.testing.assert_array_equal(_scaled(jnp.arange(4.0), scale=2.0), 2.0 * jnp.arange(4.0))
    assert all(name.startswith("ds4jax-prefetch") for name in loads[before:]), loads


def test_tags_are_separate(loads, tmp_path):
    _scaled(jnp.arange(3.0), scale=2.0)  # no prefetch announced: nothing recorded
    _new_process(tmp_path)
    assert executable_cache.prefetch("other") == 0


def test_few_cores_prefetch_the_first_program_only(loads, tmp_path, monkeypatch):
    x = jnp.arange(3.0)
    executable_cache.prefetch("run")
    _scaled(x, scale=2.0), _scaled(x, scale=3.0)
    _new_process(tmp_path)
    monkeypatch.setattr(executable_cache, "_cpus", lambda: 2)
    before = len(loads)
    assert executable_cache.prefetch("run") == 1
    np.testing.assert_array_equal(_scaled(x, scale=2.0), 2.0 * x)
    np.testing.assert_array_equal(_scaled(x, scale=3.0), 3.0 * x)
    assert [name.startswith("ds4jax-prefetch") for name in loads[before:]] == [True, False], loads
