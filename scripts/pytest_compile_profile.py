"""A pytest plugin that says where the suite's compile time goes: per test and per program, the seconds JAX spent
tracing, lowering and XLA-compiling (its `jax.monitoring` events) and the test's wall and CPU seconds.

    PYTHONPATH=scripts python -m pytest -n 2 -p pytest_compile_profile [tests...]
    python scripts/pytest_compile_profile.py /tmp/ds4jax-compile-profile   # the summary
    python scripts/pytest_compile_profile.py --totals DIR                  # the sums in two lines (.ci/run)

Each pytest process (xdist workers included) writes `<DS4JAX_COMPILE_PROFILE or /tmp/ds4jax-compile-profile>/
<worker>.json` when it ends: {test id: {"wall", "cpu", "events": {event: seconds}, "programs": {name: [compiles,
seconds]}}}. Subprocesses a test starts are not seen (their seconds show in the test's wall time only).
"""

from __future__ import annotations

import collections
import glob
import json
import os
import sys
import time

_DIR = os.environ.get("DS4JAX_COMPILE_PROFILE", "/tmp/ds4jax-compile-profile")
_current = ["<outside tests>"]
_PER_PROGRAM = {"jaxpr_trace_duration": "traced", "jaxpr_to_mlir_module_duration": "lowered"}
_tests: dict = collections.defaultdict(lambda: {"wall": 0.0, "cpu": 0.0, "events": collections.Counter(),
                                                 "programs": collections.defaultdict(lambda: [0, 0.0]),
                                                 "traced": collections.defaultdict(lambda: [0, 0.0]),
                                                 "lowered": collections.defaultdict(lambda: [0, 0.0])})


def _listener(event: str, duration: float, **kwargs) -> None:
    record = _tests[_current[0]]
    name = event.rsplit("/", 1)[-1]
    record["events"][name] += duration
    if name == "backend_compile_duration":  # cache hits are not compiles: JAX records them as another event
        program = record["programs"][kwargs.get("fun_name", "?")]
        program[0] += 1
        program[1] += duration
    elif name in _PER_PROGRAM:  # tracing and lowering, per program too: [times, seconds]
        program = record[_PER_PROGRAM[name]][kwargs.get("fun_name", "?")]
        program[0] += 1
        program[1] += duration


def pytest_configure(config):
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_listener)


def pytest_runtest_protocol(item, nextitem):
    """Starts the test's clock (returning nothing lets pytest run the test; `pytest_runtest_logfinish` stops it)."""
    _current[0] = item.nodeid
    _tests[item.nodeid]["start"] = (time.perf_counter(), time.process_time())


def pytest_runtest_logfinish(nodeid, location):
    record = _tests[nodeid]
    wall, cpu = record.pop("start", (time.perf_counter(), time.process_time()))
    record["wall"] += time.perf_counter() - wall
    record["cpu"] += time.process_time() - cpu
    _current[0] = "<outside tests>"


def pytest_unconfigure(config):
    os.makedirs(_DIR, exist_ok=True)
    with open(os.path.join(_DIR, os.environ.get("PYTEST_XDIST_WORKER", "main") + ".json"), "w") as f:
        json.dump(_tests, f)


def summary(directory: str, top: int = 25) -> str:
    """The tests and the programs that cost the most compile seconds, from every worker's file."""
    # summed over the files: under xdist the controller (main.json) also logs every test it is told about, with no
    # time of its own, and a test's record must not replace the worker's that ran it
    tests = collections.defaultdict(lambda: {"wall": 0.0, "cpu": 0.0, "events": collections.Counter()})
    programs = collections.defaultdict(lambda: [0, 0.0])
    stages = {kind: collections.defaultdict(lambda: [0, 0.0]) for kind in _PER_PROGRAM.values()}
    for path in glob.glob(os.path.join(directory, "*.json")):
        with open(path) as f:
            for test, record in json.load(f).items():
                merged = tests[test]
                merged["wall"] += record["wall"]
                merged["cpu"] += record["cpu"]
                merged["events"].update(record["events"])
                for name, (n, seconds) in record["programs"].items():
                    programs[name][0] += n
                    programs[name][1] += seconds
                for kind, per_program in stages.items():
                    for name, (n, seconds) in record.get(kind, {}).items():
                        per_program[name][0] += n
                        per_program[name][1] += seconds
    lines = ["wall s | cpu s | XLA s | trace s | lower s | test"]
    for test, r in sorted(tests.items(), key=lambda kv: -kv[1]["wall"])[:top]:
        e = r["events"]
        lines.append(f"{r['wall']:6.1f} | {r['cpu']:5.1f} | {e.get('backend_compile_duration', 0):5.1f} | "
                     f"{e.get('jaxpr_trace_duration', 0):7.1f} | {e.get('jaxpr_to_mlir_module_duration', 0):7.1f} | "
                     f"{test}")
    lines += ["", "XLA s | compiles | program"]
    for name, (n, seconds) in sorted(programs.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"{seconds:5.1f} | {n:8d} | {name}")
    for kind, per_program in stages.items():
        lines += ["", f"{kind} s | times | program"]
        for name, (n, seconds) in sorted(per_program.items(), key=lambda kv: -kv[1][1])[:top]:
            lines.append(f"{seconds:8.1f} | {n:5d} | {name}")
    return "\n".join(lines)


# the events `totals` sums, and their names in its line
_TOTALS = {"backend_compile_duration": "XLA compile", "jaxpr_trace_duration": "tracing",
           "jaxpr_to_mlir_module_duration": "lowering", "cache_retrieval_time_sec": "cache loads"}


def totals(directory: str, top: int = 8) -> str:
    """The suite's sums (test processes only: subprocesses show in their tests' wall time) and the programs that
    cost the most XLA seconds: where a run's time went, in a few lines (printed by .ci/run)."""
    sums, programs = collections.Counter(), collections.defaultdict(lambda: [0, 0.0])
    for path in glob.glob(os.path.join(directory, "*.json")):
        with open(path) as f:
            for record in json.load(f).values():
                sums.update(wall=record["wall"], cpu=record["cpu"])
                sums.update({k: v for k, v in record["events"].items() if k in _TOTALS})
                for name, (n, seconds) in record["programs"].items():
                    programs[name][0] += n
                    programs[name][1] += seconds
    head = ", ".join(f"{label} {sums[key]:,.0f} s" for key, label in _TOTALS.items())
    lines = [f"in the test processes: tests' wall {sums['wall']:,.0f} s, CPU {sums['cpu']:,.0f} s; time in {head}",
             "programs with the most XLA seconds: " + "; ".join(
                 f"{name} {seconds:.0f} s / {n}" for name, (n, seconds) in
                 sorted(programs.items(), key=lambda kv: -kv[1][1])[:top])]
    return "\n".join(lines)


if __name__ == "__main__":
    if "--totals" in sys.argv:
        print(totals(([a for a in sys.argv[1:] if a != "--totals"] or [_DIR])[0]))
    else:
        print(summary(sys.argv[1] if len(sys.argv) > 1 else _DIR))
