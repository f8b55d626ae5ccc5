"""Where a new process's start-up goes: a timeline of one ``ds4jax`` command (or one Engine warm-up) in this process,
from the interpreter's start: module imports, every XLA compile (its program and seconds, from JAX's
``jax_log_compiles`` records), persistent-cache hits, the first byte written to stdout, the end.

    python scripts/startup_timeline.py --out t.json -- generate --prompt "def fibonacci(n):" --max-new-tokens 64
    python scripts/startup_timeline.py --out t.json --warmup            # Engine(default_model(), 8, 512).warmup()
    python scripts/startup_timeline.py --render t1.json t2.json ...     # a markdown summary of the records

Run each in a fresh process (the cache directory is the environment's: ``DS4JAX_COMPILATION_CACHE``). A cold run
and a cached one side by side show what the compiler costs and what remains without it (imports, loads,
tiny programs, the first run).
"""

from __future__ import annotations

import time

T0 = time.perf_counter()  # before anything else is imported

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402

EVENTS: list[dict] = []
_lock = threading.Lock()


def event(kind: str, **fields) -> None:
    with _lock:
        EVENTS.append({"t": round(time.perf_counter() - T0, 4), "kind": kind,
                       "thread": threading.current_thread().name, **fields})


class _CompileLog(logging.Handler):
    """JAX's compile records ("Finished XLA compilation of jit(f) in 0.12 sec", cache hits/misses), as events."""

    done = re.compile(r"Finished XLA compilation of (\S+) in ([0-9.e+-]+) sec")
    other = re.compile(r"(Persistent compilation cache hit|Not writing persistent cache entry|Writing \S+ to "
                       r"persistent compilation cache|Finished tracing \+ transforming (\S+) in ([0-9.e+-]+) sec"
                       r"|Finished jaxpr to MLIR module conversion (\S+) in ([0-9.e+-]+) sec)")

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        m = self.done.search(msg)
        if m:
            event("compile", program=m.group(1), seconds=float(m.group(2)))
            return
        m = self.other.search(msg)
        if m:
            event("jax", message=msg[:160])


class _FirstByte:
    """Wraps stdout: records when the first byte is written (what a user waiting on the prompt sees)."""

    def __init__(self, out):
        self._out, self.seen = out, False

    def write(self, s):
        if s and not self.seen:
            self.seen = True
            event("first_byte")
        return self._out.write(s)

    def __getattr__(self, name):
        return getattr(self._out, name)


def _instrument() -> None:
    import jax

    event("import_jax")
    jax.config.update("jax_log_compiles", True)
    handler = _CompileLog()
    for name in ("jax._src.dispatch", "jax._src.interpreters.pxla", "jax._src.compiler", "jax._src.cache_key",
                 "jax._src.compilation_cache"):
        log = logging.getLogger(name)
        log.addHandler(handler)
        log.setLevel(logging.DEBUG)
        log.propagate = False  # keep the terminal quiet; the records land in EVENTS


def _wrap(module, name: str, kind: str) -> None:
    """Record when `module.name` (a function) starts and ends, as `kind` events."""
    inner = getattr(module, name)

    def timed(*a, **k):
        event(f"{kind}_start")
        try:
            return inner(*a, **k)
        finally:
            event(f"{kind}_end")

    setattr(module, name, timed)


def _hooks() -> None:
    """Progress lines of the command, and our executable cache's loads and compiles (not JAX's, so not in its
    compile records)."""
    from ds4jax.commands import options
    from ds4jax.runtime import executable_cache

    from jax._src import xla_bridge

    backends, ready = xla_bridge.backends, []

    def timed_backends(*a, **k):  # the first return: JAX's backends (CUDA context, plugin, allocator) are up
        out = backends(*a, **k)
        if not ready:
            ready.append(True)
            event("backend_ready")
        return out

    xla_bridge.backends = timed_backends
    say = options.Progress.__call__
    options.Progress.__call__ = lambda self, message: (event("progress", message=message[:120]), say(self, message))
    _wrap(executable_cache, "_load", "exe_load")
    _wrap(executable_cache, "_compile_and_store", "exe_compile")


def _warmup() -> None:
    from ds4jax import Engine, default_model

    model = default_model()
    event("model_loaded")
    engine = Engine(model, max_slots=8, max_context=512)
    event("engine_built")
    report = engine.warmup()
    event("warmup_done", report=str(report))


def render(paths: list[str]) -> str:
    lines = ["| run | what | first byte / warm-up end | end | imports done | compiles (sum s, count) | "
             "longest compile | cache hits |", "|---|---|---|---|---|---|---|---|"]
    for path in paths:
        r = json.load(open(path))
        ev = r["events"]
        t = lambda kind: next((e["t"] for e in ev if e["kind"] == kind), None)  # noqa: E731
        comps = [e for e in ev if e["kind"] == "compile"]
        longest = max(comps, key=lambda e: e["seconds"], default=None)
        hits = sum("cache hit" in e.get("message", "") for e in ev)
        first = t("first_byte") if t("first_byte") is not None else t("warmup_done")
        lines.append(f"| {r['label']} | {' '.join(r['argv']) or 'warmup'} | {first} s | {t('end')} s | "
                     f"{t('imported')} s | {sum(e['seconds'] for e in comps):.2f} s, {len(comps)} | "
                     f"{longest['program'] if longest else '-'} {longest['seconds'] if longest else 0:.2f} s | "
                     f"{hits} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--label", default="")
    ap.add_argument("--warmup", action="store_true", help="time Engine(default_model()).warmup() instead")
    ap.add_argument("--render", nargs="+", help="print a markdown summary of these records and exit")
    ap.add_argument("argv", nargs="*", help="the ds4jax command line (after --)")
    args = ap.parse_args()
    if args.render:
        print(render(args.render))
        return 0
    _instrument()
    import ds4jax.cli  # noqa: F401

    event("imported")
    _hooks()
    status = 0
    if args.warmup:
        _warmup()
    else:
        sys.stdout = _FirstByte(sys.stdout)
        status = ds4jax.cli.main(args.argv)
        sys.stdout.flush()
    event("end", status=status)
    record = {"label": args.label, "argv": args.argv, "events": EVENTS,
              "env": {k: v for k, v in os.environ.items() if k.startswith(("DS4JAX_", "XLA_", "JAX_"))}}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    comps = [e for e in EVENTS if e["kind"] == "compile"]
    print(f"[timeline] {args.label}: end {EVENTS[-1]['t']} s, first byte "
          f"{next((e['t'] for e in EVENTS if e['kind'] == 'first_byte'), '-')} s, {len(comps)} compiles "
          f"{sum(e['seconds'] for e in comps):.2f} s", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
