"""A one-shot engine's decode programs compiled while its prefill compiles, when nobody waits for a first token.

`generate()` builds an engine for one call and never warms it up: each program compiles at its first call, so
the decode program's compile starts only after the prefill's has finished and run. `start` lowers the decode (and
speculative) programs of every row bucket here, as the warm-up's capture pass does, and compiles each on a
background thread from the moment it is lowered, beside the prefill's compile on the calling thread (XLA compiles
without the GIL). The engine's programs become `AfterCompile`, whose decode and speculate wait for it first, so
a program is never compiled twice; a compile that failed there is left to the call, which compiles it itself and
raises its own error.

Two compiles at once share the host's cores, so the prefill's own compile takes longer. On the 2-core CPU, a cold
`generate()` of the default model (18-token prompt, 64 greedy tokens; `scripts/bench_compile_ahead.py`,
docs/benchmarks/compile_ahead_cpu.json, medians of 3 fresh processes) finished in 10.22 s instead of 12.37 s, and
a streaming call forced to compile ahead saw its first token later (see that file). So by default only calls that
do not stream compile ahead (`generate()` without `on_token`); ``ds4jax generate``, which prints each token as it
comes, compiles its decode program after the first token as before. Lowering here costs ~0.9 s on the 2-core CPU,
and next to nothing when the programs are already compiled in the process.
``DS4JAX_COMPILE_AHEAD``: on (the default), always (streaming calls too) or off.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

from ds4jax.runtime import precompile

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(1, "ds4jax-compile-ahead")
        return _pool


def setting() -> str:
    """``DS4JAX_COMPILE_AHEAD``: "on" (the default: calls that do not stream), "always" (streaming calls too) or
    "off"."""
    value = os.environ.get("DS4JAX_COMPILE_AHEAD", "on").lower()
    if value not in ("on", "always", "off"):
        raise ValueError(f"DS4JAX_COMPILE_AHEAD={value!r}: expected on, always or off")
    return value


def start(engine, *, streaming: bool) -> bool:
    """Start compiling `engine`'s decode and speculative programs (for a streaming call only under "always");
    False when it did not: the setting, nothing to compile (the programs are in memory already), or programs that
    compile stage by stage (a layer split)."""
    chosen = setting()
    if chosen == "off" or (streaming and chosen != "always"):
        return False
    if not engine.programs.precompiles or isinstance(engine.programs, AfterCompile):
        return False
    try:
        # one thread: each program compiles from the moment it is lowered, while the next one lowers (as in the
        # warm-up), beside the prefill's compile on the calling thread
        with precompile.capturing(threads=1) as jobs:
            for *_, run in engine._decode_program_calls():  # the warm-up's decode and speculative calls
                precompile.run_captured(run)
    except Exception:  # noqa: BLE001 (tracing or lowering failed: the call meets it again and reports it)
        return False
    if not any(job.compile is not None for job in jobs):
        return False
    engine.programs = AfterCompile(engine.programs, _executor().submit(precompile.compile_all, jobs))
    return True


class AfterCompile:
    """The engine's `Programs` whose decode and speculate first let the compile started by `start` finish (a
    failure there is the call's to meet: it compiles the program itself and raises its own error); everything
    else is the wrapped programs'."""

    def __init__(self, programs, compiling: concurrent.futures.Future):
        self._programs, self._compiling = programs, compiling

    def _wait(self) -> None:
        compiling, self._compiling = self._compiling, None
        if compiling is not None:
            try:
                compiling.result()
            except Exception:  # noqa: BLE001
                pass

    def decode(self, *args, **kwargs):
        self._wait()
        return self._programs.decode(*args, **kwargs)

    def speculate(self, *args, **kwargs):
        self._wait()
        return self._programs.speculate(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._programs, name)
