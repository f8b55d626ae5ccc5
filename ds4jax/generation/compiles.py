"""Counts this process's XLA compilations through JAX's monitoring events (every jitted program, ours or not).

JAX reports each backend compile (a persistent-cache hit included: it is timed as a compile that returned
early) and each persistent-cache hit separately, so a count minus its hits is the work the compiler really did.
`CompileTotals` are cumulative; subtract two to measure a span (`Engine.warmup` does per program).
`program_compiles` counts them per program name (``jit(prefill_call)``), for a test that says which recompiled.
"""

from __future__ import annotations

import collections
import dataclasses
import threading

import jax

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_DISK_HIT = "/jax/compilation_cache/cache_hits"


@dataclasses.dataclass(frozen=True)
class CompileTotals:
    compiles: int = 0  # backend compiles, persistent-cache hits included
    seconds: float = 0.0  # time inside them
    disk_hits: int = 0  # of which loaded from the persistent compilation cache

    def __sub__(self, other: "CompileTotals") -> "CompileTotals":
        return CompileTotals(self.compiles - other.compiles, self.seconds - other.seconds,
                             self.disk_hits - other.disk_hits)


_totals = [CompileTotals()]  # one cell: the listeners replace it (a frozen record per event)
_thread = threading.local()  # the same per thread (compiles run on a pool during warm-up: runtime/precompile.py)
_by_name: collections.Counter = collections.Counter()  # program name -> backend compiles (hits included)
_names_lock = threading.Lock()


def _on_duration(event: str, duration: float, **kwargs) -> None:
    if event == _BACKEND_COMPILE:
        t = _totals[0]
        _totals[0] = dataclasses.replace(t, compiles=t.compiles + 1, seconds=t.seconds + duration)
        mine = thread_totals()
        _thread.totals = dataclasses.replace(mine, compiles=mine.compiles + 1, seconds=mine.seconds + duration)
        with _names_lock:
            _by_name[kwargs.get("fun_name", "?")] += 1


def _on_event(event: str, **kwargs) -> None:
    if event == _DISK_HIT:
        _totals[0] = dataclasses.replace(_totals[0], disk_hits=_totals[0].disk_hits + 1)
        _thread.totals = dataclasses.replace(thread_totals(), disk_hits=thread_totals().disk_hits + 1)


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


def totals() -> CompileTotals:
    """Compilations in this process so far."""
    return _totals[0]


def thread_totals() -> CompileTotals:
    """Compilations run on the calling thread so far."""
    return getattr(_thread, "totals", CompileTotals())


def compile_count() -> int:
    """XLA compilations in this process so far (every jitted program, ours or not)."""
    return _totals[0].compiles


def program_compiles() -> collections.Counter:
    """Backend compiles in this process so far per program name (JAX's, e.g. ``jit(decode_loop)``); subtract two
    copies to see what a span compiled."""
    with _names_lock:
        return collections.Counter(_by_name)
