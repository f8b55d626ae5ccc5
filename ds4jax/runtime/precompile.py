"""Compile several programs at once: capture each program call (trace and lower it on this thread, run nothing),
then compile the lowered programs on a pool of threads.

XLA's compiler releases the GIL, so an engine's programs (a prefill and a decode per row bucket, ...) compile side
by side on the host's cores instead of one after another; tracing and lowering stay on the calling thread, inside
the caller's contexts (a mesh, a default device), which threads would not inherit. The compiled executables land
where the later call looks: JAX's in-process cache of the jitted function (an AOT `lower().compile()` fills it) or
`executable_cache`'s memory when that cache is on.

    with precompile.capturing() as jobs:
        for thunk in program_calls:
            precompile.run_captured(thunk)  # the thunk's first `cached_jit` call is captured, not run
    results = precompile.compile_all(jobs)

`capturing(threads=n)` starts each job's compile on the pool as soon as it is captured, so the first programs
compile while the next ones trace and lower (an Engine warm-up's capture pass is seconds of Python: serial
before the pool, it stood on the critical path); `compile_all` then waits for those jobs.

`DS4JAX_COMPILE_THREADS` sets the pool size (default: one per core, at most one per program; 1 = serial).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import threading
import time
from typing import Callable, Iterator

from ds4jax.generation import compiles

_state = threading.local()


class Captured(Exception):
    """Raised by a captured program call, unwinding the caller before it uses the (absent) result."""


@dataclasses.dataclass
class Job:
    name: str
    # what the pool runs: a compile, or (executable cache) a stored program's load; None: in memory, nothing to do
    compile: Callable[[], object] | None
    # set when `capturing(threads=...)` started the compile at capture: its `Compiled`, once done
    started: concurrent.futures.Future | None = None


@dataclasses.dataclass(frozen=True)
class Compiled:
    name: str
    seconds: float  # wall time of this program's job on its thread (its compile, or its load)
    totals: compiles.CompileTotals  # the XLA compilations it ran (cache hits included)


def active() -> bool:
    return getattr(_state, "jobs", None) is not None


def capture(job: Job) -> None:
    """Called by a program wrapper in capture mode: record the job (starting its compile on the capture's pool,
    if it has one) and unwind the caller."""
    pool = getattr(_state, "pool", None)
    if pool is not None and job.compile is not None:
        job.started = pool.submit(_timed, job)
    _state.jobs.append(job)
    raise Captured(job.name)


@contextlib.contextmanager
def capturing(threads: int | None = None) -> Iterator[list[Job]]:
    """Capture program calls (see the module's docstring). `threads`: compile each job on a pool of that many
    threads from the moment it is captured (None: `compile_all` compiles them all afterwards)."""
    if active():
        raise RuntimeError("precompile.capturing() is not reentrant")
    pool = None if threads is None else concurrent.futures.ThreadPoolExecutor(max(1, threads), "ds4jax-compile")
    jobs: list[Job] = []
    _state.jobs, _state.pool = jobs, pool
    try:
        yield jobs
    finally:
        _state.jobs = _state.pool = None
        if pool is not None:
            pool.shutdown(wait=False)  # the jobs it holds still run; compile_all waits for them


def run_captured(thunk: Callable[[], object]) -> bool:
    """Run `thunk` until its first program call is captured; True if one was (False: it ran to the end)."""
    try:
        thunk()
    except Captured:
        return True
    return False


def threads(n_jobs: int) -> int:
    env = os.environ.get("DS4JAX_COMPILE_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"DS4JAX_COMPILE_THREADS={env!r}: expected a positive integer") from None
        if n < 1:
            raise ValueError(f"DS4JAX_COMPILE_THREADS={env!r}: expected a positive integer")
        return min(n, max(n_jobs, 1))
    return max(1, min(n_jobs, os.cpu_count() or 1))


def _timed(job: Job) -> Compiled:
    """Run one job on this thread, inside its own `_fresh_scope` (a thread's own setting)."""
    with _fresh_scope():
        before, start = compiles.thread_totals(), time.perf_counter()
        job.compile()
        return Compiled(job.name, time.perf_counter() - start, compiles.thread_totals() - before)


def compile_all(jobs: list[Job]) -> list[Compiled | None]:
    """Compile the captured jobs on a thread pool (or wait for those `capturing(threads=...)` started); one entry
    per job (None where there was nothing to do). The first failure is raised after every job has finished."""
    todo = [j for j in jobs if j.compile is not None and j.started is None]
    futures = {id(j): j.started for j in jobs if j.started is not None}
    if todo:
        with concurrent.futures.ThreadPoolExecutor(threads(len(todo)), "ds4jax-compile") as pool:
            futures.update({id(j): pool.submit(_timed, j) for j in todo})
            concurrent.futures.wait(futures.values())
    concurrent.futures.wait(futures.values())
    return [futures[id(j)].result() if j.compile is not None else None for j in jobs]


@contextlib.contextmanager
def _fresh_scope():
    """executable_cache compiles must not be served by JAX's persistent cache (see `_fresh_compile`); the setting
    is the compiling thread's own (`executable_cache.fresh_compiles`), so each job holds it while it runs."""
    from ds4jax.runtime import executable_cache

    with executable_cache.fresh_compiles() if executable_cache.enabled() else contextlib.nullcontext():
        yield
