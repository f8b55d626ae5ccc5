"""An opt-in per-program compile log for the suite's worker subprocesses (tests/mesh_worker.py,
tests/multiprocess_worker.py), which scripts/pytest_compile_profile.py does not see.

With DS4JAX_WORKER_COMPILE_LOG=DIR, a worker process writes DIR/<worker>-<pid>.json when it exits:
{"phases": {phase: {"cpu": s, "wall": s}}, "programs": {phase: {program: [compiles, cache hits, trace s, lower s,
XLA s]}}}, from JAX's `jax.monitoring` events (as the plugin reads them). A hit of the run's compilation cache
(tests/run_cache.py) is counted apart: JAX times the load as a backend compile too. `phase(name)` labels what
follows (the worker's case); `write()` writes at once (a process about to be killed). Without the variable nothing is registered.

    python tests/compile_log.py DIR   # the summary: phases, then the programs that cost the most
"""

from __future__ import annotations

import atexit
import collections
import glob
import json
import os
import sys
import time

ENV = "DS4JAX_WORKER_COMPILE_LOG"
_state = {"phase": "start", "hit": False}
_programs: dict = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0, 0.0, 0.0, 0.0]))
_phases: dict = {}
_clock = [time.perf_counter(), time.process_time()]


def _close_phase() -> None:
    wall, cpu = time.perf_counter(), time.process_time()
    record = _phases.setdefault(_state["phase"], {"cpu": 0.0, "wall": 0.0})
    record["wall"] += wall - _clock[0]
    record["cpu"] += cpu - _clock[1]
    _clock[:] = [wall, cpu]


def phase(name: str) -> None:
    """What follows belongs to `name` (until the next call)."""
    _close_phase()
    _state["phase"] = name


def _on_event(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":  # fires inside the backend compile it replaces
        _state["hit"] = True


def _on_duration(event: str, duration: float, **kwargs) -> None:
    name = event.rsplit("/", 1)[-1]
    column = {"jaxpr_trace_duration": 2, "jaxpr_to_mlir_module_duration": 3, "backend_compile_duration": 4}.get(name)
    if column is None:
        return
    record = _programs[_state["phase"]][kwargs.get("fun_name", "?")]
    record[column] += duration
    if column == 4:
        record[1 if _state["hit"] else 0] += 1
        _state["hit"] = False


def install(worker: str) -> None:
    """Start logging when the environment asks for it (call after JAX is importable, before any compile)."""
    where = os.environ.get(ENV)
    if not where:
        return
    import jax.monitoring

    jax.monitoring.register_event_listener(_on_event)
    jax.monitoring.register_event_duration_secs_listener(_on_duration)

    _state["path"] = os.path.join(where, f"{worker}-{os.getpid()}.json")
    atexit.register(write)


def write() -> None:
    """Write the log now (again at exit): for a process that may not reach its exit handlers (killed)."""
    if "path" not in _state:
        return
    _close_phase()
    os.makedirs(os.path.dirname(_state["path"]), exist_ok=True)
    with open(_state["path"], "w") as f:
        json.dump({"phases": _phases, "programs": _programs}, f)


def summary(directory: str, top: int = 30) -> str:
    lines = []
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        with open(path) as f:
            log = json.load(f)
        lines.append(f"== {os.path.basename(path)}: cpu {sum(p['cpu'] for p in log['phases'].values()):.1f} s")
        lines.append("  cpu s | wall s | compiles | hits | XLA s | trace s | lower s | phase")
        for name, p in log["phases"].items():
            progs = log["programs"].get(name, {}).values()
            n, hits, tr, lo, xla = (sum(r[i] for r in progs) for i in range(5))
            lines.append(f"  {p['cpu']:5.1f} | {p['wall']:6.1f} | {n:8d} | {hits:4d} | {xla:5.1f} | {tr:7.1f} | "
                         f"{lo:7.1f} | {name}")
        merged = collections.defaultdict(lambda: [0, 0, 0.0, 0.0, 0.0])
        for progs in log["programs"].values():
            for name, r in progs.items():
                merged[name] = [a + b for a, b in zip(merged[name], r)]
        lines.append("  XLA s | compiles | hits | trace s | lower s | program")
        for name, r in sorted(merged.items(), key=lambda kv: -kv[1][4])[:top]:
            lines.append(f"  {r[4]:5.1f} | {r[0]:8d} | {r[1]:4d} | {r[2]:7.1f} | {r[3]:7.1f} | {name}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(sys.argv[1]))
