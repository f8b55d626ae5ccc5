"""The test run's shared compilation cache: one JAX persistent-cache directory for every process of one pytest run.

The suite is compile-bound (tiny models, programs that run for microseconds), and its processes compile many of
the same programs: both xdist workers build the default and tiny models' steps, the notebook kernels and the
CLI / batch / mesh subprocesses build them again, and a worker that drops its executables (conftest's mapping
guard) rebuilds what it dropped. With one directory, each program is compiled once per run and loaded by the
others (measured on the 2-core machine, `.ci/run` in a fresh clone: the suite 855 s before, 606 to 682 s in
four runs with this cache and the cheaper flags of cheap_compile.py).

It is set at JAX's level, through the environment JAX reads at import (`JAX_COMPILATION_CACHE_DIR` and both
thresholds at 0), so every process inherits it and caches every program from its first. ds4jax's own policy
stays as the tests left it before (`DS4JAX_COMPILATION_CACHE=off` in conftest: the CLI called in process neither
turns on its executable cache nor writes into ~/.cache), and tests of that policy set these variables aside
(test_compilation_cache*.py). A cache hit still counts as a compile in `ds4jax.generation.compiles` (JAX times
it as one), so the tests that count compiles after a warm-up see the same numbers either way.

The pytest process that starts first (the xdist controller, or the only process without xdist) makes a fresh
temporary directory and removes it when it exits; its workers and every subprocess inherit it. A clean checkout
therefore always starts cold, as CI does. `DS4JAX_TEST_COMPILATION_CACHE=<dir>` keeps a directory across runs
instead (a developer's loop), and `DS4JAX_TEST_COMPILATION_CACHE=off` runs every process uncached.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

ENV = "DS4JAX_TEST_COMPILATION_CACHE"
_RUN = "DS4JAX_TEST_RUN_CACHE"  # set by the first process of the run; inherited by the rest
JAX_ENV = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}


def directory() -> str | None:
    """The run's cache directory, or None when off."""
    chosen = os.environ.get(ENV)
    if chosen:
        return None if chosen == "off" else os.path.abspath(chosen)
    if _RUN not in os.environ:  # the run's first process: the directory is ours to remove
        made = tempfile.mkdtemp(prefix="ds4jax-test-cache-")
        os.environ[_RUN] = made
        atexit.register(shutil.rmtree, made, ignore_errors=True)
    return os.environ[_RUN]


def configure(environ=os.environ) -> str | None:
    """Point JAX at the run's directory through `environ` (before JAX is imported). -> the directory or None.
    A directory the caller already gave JAX (JAX_COMPILATION_CACHE_DIR) is kept."""
    where = directory()
    if where is None:
        return None
    environ.setdefault("JAX_COMPILATION_CACHE_DIR", where)
    for name, value in JAX_ENV.items():
        environ.setdefault(name, value)
    # the pip triton that compiles the kernels for GPU targets (tests/rocm) caches in ~/.triton unless told: keep
    # its entries in the run's directory too, so a run never finds a warm cache an earlier run left behind
    environ.setdefault("TRITON_CACHE_DIR", os.path.join(where, "triton"))
    return environ["JAX_COMPILATION_CACHE_DIR"]


def without(environ) -> dict:
    """`environ` minus the run cache's JAX variables: for a subprocess that must see ds4jax's own cache policy."""
    return {k: v for k, v in environ.items() if k != "JAX_COMPILATION_CACHE_DIR" and k not in JAX_ENV}
