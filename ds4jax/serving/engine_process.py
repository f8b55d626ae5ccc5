"""`ds4jax serve --engine-process`: the engine in a process of its own, the HTTP front end in the server's.

In one process the thread that drives the `Engine` and the event loop (HTTP, SSE, detokenization) share one GIL:
at 32 streams on the H200 they needed ~7.4 ms of it per 7.7 ms engine call, so calls started late and the server
gave 33 % fewer tokens/s than the engine alone (docs/benchmarks/serve.md). Here the engine process runs the same
`Driver` and nothing of HTTP; its interpreter's serving work is one pickled message per engine iteration.

Engine process (`engine_main`, spawned): builds the engine (`build()`), sends ``("info", EngineInfo)``, then its main
thread reads the front end's messages (submit, cancel, stop, drain, call) and the driver's thread runs the engine.
The driver's hand-overs go to an outbox that is sent as ONE ``("batch", items, waiting, running, stats)`` message
per engine iteration (a job's first token at once, as in one process). SIGINT / SIGTERM are ignored there (a
terminal's Ctrl-C or a group kill reaches both processes; the front end drains, then closes the pipe), and it
exits when the pipe closes: the front end's exit or death (no orphan).

Front end (`EngineProcess`, `RemoteDriver`): `RemoteDriver` offers what app.py uses of `Driver` (start, state,
error, ready, submit with QueueFull / NotAccepting, cancel, depth, stop_accepting, drain, wait_idle) and keeps the
metrics (time to first token and gaps as the front end receives the tokens). Admission is decided here: the
waiting jobs are those in flight less those the engine last reported running. A dead engine process turns the
state to "failed" with its exit status, and every job in flight gets an error result.

Messages are pickled tuples between these two processes only (`multiprocessing.connection`); a `Request`'s
callbacks do not travel: the engine side rebuilds it from its fields.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
import types
from typing import Callable

from ds4jax.generation.requests import (
    ErrorCode,
    FinishReason,
    GenerateResult,
    Request,
    TokenEvent,
    TokenLogprob,
)
from ds4jax.serving.driver import Driver, Job, NotAccepting, QueueFull, mark

log = logging.getLogger("ds4jax.serve")

_CALLBACKS = ("on_token", "on_tokens")
_FIELDS = tuple(f.name for f in dataclasses.fields(Request) if f.name not in _CALLBACKS)


# ---- wire format ---------------------------------------------------------------------------------------------------
def request_fields(request: Request) -> dict:
    """A `Request`'s fields without its callbacks (which stay in the front end)."""
    return {name: getattr(request, name) for name in _FIELDS}


def pack_events(events: list[TokenEvent]) -> tuple:
    """One job's token events of one hand-over (consecutive indices) -> (first index, tokens, logprobs or None):
    plain values pickle several times faster than the frozen dataclasses."""
    logprobs = None
    if events[0].logprob is not None:
        logprobs = [None if e.logprob is None else (e.logprob.logprob, e.logprob.top) for e in events]
    return events[0].index, [e.token for e in events], logprobs


def unpack_events(packed: tuple) -> list[TokenEvent]:
    start, tokens, logprobs = packed
    if logprobs is None:
        return [TokenEvent(0, t, start + i) for i, t in enumerate(tokens)]
    return [TokenEvent(0, t, start + i, None if lp is None else TokenLogprob(*lp))
            for i, (t, lp) in enumerate(zip(tokens, logprobs))]


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """What the front end needs of the engine: the limits requests are checked against, and its tokenizer."""
    max_slots: int
    max_context: int
    k: int
    vocab_size: int
    logprobs: int
    steps_per_call: int
    tokenizer: object

    @classmethod
    def of(cls, engine) -> EngineInfo:
        return cls(engine.tspec.max_slots, engine.tspec.max_context, engine.k, engine.cfg.vocab_size, engine.logprobs,
                   engine.steps_per_call, engine.tokenizer)


class EngineView:
    """The front end's stand-in for the engine: the fields `Server` reads (limits; `stats` as last reported)."""

    def __init__(self, info: EngineInfo):
        self.info = info
        self.tspec = types.SimpleNamespace(max_slots=info.max_slots, max_context=info.max_context)
        self.cfg = types.SimpleNamespace(vocab_size=info.vocab_size)
        self.k, self.logprobs, self.steps_per_call = info.k, info.logprobs, info.steps_per_call
        self.stats = types.SimpleNamespace(compiles_after_warmup=0, spec_rounds=0, lookup_drafts=0, lookup_skips=0)


# ---- the engine process --------------------------------------------------------------------------------------------
class _HostDriver(Driver):
    """The `Driver` of the engine process: its hand-overs fill the host's outbox, sent once per iteration."""
    QUEUED_MARK = "arrived"  # the front end stamped "queued" as it sent the job

    def __init__(self, engine, host: EngineHost):
        super().__init__(engine, max_queue=1 << 62)  # admission is the front end's
        self.host = host

    def _after_iteration(self) -> None:
        self.host.send_batch()

    def _set_state(self, state: str) -> None:
        super()._set_state(state)
        self.host.send(("state", state, self.error))

    def on_tokens(self, job: Job):
        deliver, send = super().on_tokens(job), self.host.send_batch

        def first_at_once(events):
            go_on = deliver(events)
            if events[0].index == 0:  # the driver handed it over at once; the front end gets it at once too
                send()
            return go_on

        return first_at_once


class EngineHost:
    """The engine process's side of the pipe: rebuilds jobs, runs the driver, sends what it hands over."""

    def __init__(self, conn, engine):
        self.conn, self.engine = conn, engine
        # Two locks, so that no thread waits on a send while holding what the pipe-reading main thread needs (it
        # must keep reading, or both processes could block on full pipes): the outbox's (held briefly: the
        # driver's hand-overs, a cancelled job's result) and the pipe's (one message at a time, in outbox order).
        self._outbox_lock = threading.Lock()
        self._send_lock = threading.RLock()
        self._outbox: list = []
        self._sent_depth = (0, 0)
        self.jobs: dict[int, Job] = {}
        self.driver = _HostDriver(engine, self)

    def send(self, message) -> None:
        with self._send_lock:
            with contextlib.suppress(OSError, ValueError):  # the front end is gone: the main thread exits
                self.conn.send(message)

    def send_batch(self) -> None:
        """The outbox (and the queue depth, when it changed) as one message."""
        d = self.driver
        with self._send_lock:
            with self._outbox_lock:
                depth = (len(d._waiting), len(d._running))
                if not self._outbox and depth == self._sent_depth:
                    return
                items, self._outbox, self._sent_depth = self._outbox, [], depth
            stats = self.engine.stats
            self.send(("batch", [(key, kind, pack_events(value) if kind == "tokens" else value)
                                 for key, kind, value in items], *depth,
                       (stats.compiles_after_warmup, stats.spec_rounds, stats.lookup_drafts, stats.lookup_skips)))

    def _sink(self, key: int, job: Job) -> Callable[[str, object], None]:
        def sink(kind: str, value) -> None:
            with self._outbox_lock:
                if kind == "done" and job.trace:  # a traced job's stamps here go to the front end's job
                    self._outbox.append((key, "trace", job.trace))
                self._outbox.append((key, kind, value))
                if kind == "done":
                    self.jobs.pop(key, None)

        return sink

    def serve(self) -> None:
        """Read the front end's messages until its end of the pipe closes."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                return
            kind = message[0]
            if kind == "submit":
                self._submit(message[1])
            elif kind == "cancel":
                job = self.jobs.get(message[1])
                if job is not None:
                    self.driver.cancel(job)
                    self.send_batch()  # a waiting job's result is ready now
            elif kind == "stop":
                self.driver.stop_accepting()
            elif kind == "start":
                self.driver.admit_quiet_s = message[2]
                self.driver.start(warmup=message[1])
            elif kind == "drain":
                threading.Thread(target=self._drain, args=(message[1],), name="ds4jax-drain", daemon=True).start()
            elif kind == "call":
                threading.Thread(target=self._call, args=message[1:], name="ds4jax-call", daemon=True).start()
            elif kind == "exit":
                return

    def _submit(self, items) -> None:
        jobs = []
        for key, label, fields, traced in items:
            job = Job(request=None, sink=None, label=label, trace={} if traced else None)
            job.sink = self._sink(key, job)
            job.request = Request(**fields, on_tokens=self.driver.on_tokens(job))
            self.jobs[key] = job
            jobs.append(job)
        try:
            self.driver.submit(jobs)
        except (NotAccepting, QueueFull) as e:  # the front end had not heard yet: it stopped, or the engine failed
            for job in jobs:
                job.sink("done", GenerateResult(finish_reason=FinishReason.CANCELLED.value, error=ErrorCode.CANCELLED,
                                                message=f"the server is {e}"))
            self.send_batch()

    def _drain(self, grace_s: float) -> None:
        finished, cancelled = self.driver.drain(grace_s)
        self.send_batch()
        self.send(("drained", finished, cancelled))

    def _call(self, key: int, fn, args) -> None:
        try:
            answer = ("answer", key, True, fn(self, *args))
        except Exception as exc:  # noqa: BLE001 - the caller raises it
            answer = ("answer", key, False, repr(exc))
        self.send(answer)


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling (a `UsageError` naming a flag), else a RuntimeError with its text."""
    try:
        return pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def engine_main(conn, build: Callable[[], object], log_level: int = logging.INFO) -> None:
    """The engine process: build the engine, report it, serve the front end until the pipe closes, exit."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # the front end owns shutdown (see the module's docstring)
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s[engine] %(levelname)s %(message)s")
    logging.getLogger("ds4jax").setLevel(log_level)
    building = True

    def orphan_watch() -> None:  # the front end sends nothing until the engine is built: readable means closed
        while building:
            if conn.poll(0.5) and building:
                os._exit(1)

    threading.Thread(target=orphan_watch, name="ds4jax-orphan-watch", daemon=True).start()
    try:
        engine = build()
        host = EngineHost(conn, engine)
        info = EngineInfo.of(engine)
    except BaseException as exc:  # noqa: BLE001 - reported to the front end, which raises it
        with contextlib.suppress(OSError, ValueError):
            conn.send(("error", _portable(exc)))
        logging.shutdown()
        os._exit(1)
    building = False
    conn.send(("info", info))
    host.serve()
    logging.shutdown()
    os._exit(0)  # the front end is gone; whatever the engine thread was doing is moot


# ---- the front end ---------------------------------------------------------------------------------------------------
class EngineProcess:
    """Spawn the engine process and wait until `build` has built its engine (raises what `build` raised)."""

    def __init__(self, build: Callable[[], object], *, log_level: int = logging.INFO):
        ctx = multiprocessing.get_context("spawn")  # a fork would copy the parent's threads' locks (and JAX's)
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=engine_main, args=(child, build, log_level), name="ds4jax-engine",
                                daemon=True)
        self.proc.start()
        child.close()
        atexit.register(self.close)  # before multiprocessing's own exit hook, which would wait for it
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            self.close()
            raise RuntimeError(f"the engine process {_exit_status(self.proc.exitcode)} before it was built") from None
        if message[0] == "error":
            self.close()
            raise message[1]
        self.info: EngineInfo = message[1]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def close(self, timeout: float = 10.0) -> None:
        """Tell the engine process to exit and wait for it (its end of the pipe closes: a thread reading ours sees
        the end); kill it if it lingers. (Closing our end first would not do: a thread blocked reading it keeps the
        socket open.)"""
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(("exit",))
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout)


def _exit_status(code: int | None) -> str:
    if code is None:
        return "is still running"
    return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"


class RemoteDriver:
    """`Driver`'s interface over an `EngineProcess`."""

    def __init__(self, process: EngineProcess, *, max_queue: int, metrics=None, batch=contextlib.nullcontext,
                 engine: EngineView | None = None, admit_quiet_s: float = 0.0):
        self.process, self.conn = process, process.conn
        self.engine = engine or EngineView(process.info)  # the server's: the stats it reports are the engine's
        self.max_queue, self.metrics, self._batch_context = max_queue, metrics, batch
        self.admit_quiet_s = admit_quiet_s  # the engine process's driver's (`Driver`)
        # its state (held briefly, never while sending: the receiving thread must keep reading, or both processes
        # could block on full pipes), and one message at a time
        self._lock, self._send_lock = threading.RLock(), threading.RLock()
        self._jobs: dict[int, Job] = {}  # in flight, by key
        self._keys = itertools.count()
        self._running = 0  # as the engine last reported
        self._accepting, self._closing = True, False
        self._inflight: list[Job] | None = None
        self._drained = threading.Event()
        self._calls: dict[int, list] = {}
        self.state = "starting"
        self.error: str | None = None
        self.warmup_report = None  # the engine process logs it
        self._thread = threading.Thread(target=self._receive, name="ds4jax-engine-link", daemon=True)

    @classmethod
    def factory(cls, process: EngineProcess):
        """For `Server(driver=...)`: (engine, max_queue=, metrics=, batch=, admit_quiet_s=) -> a RemoteDriver."""
        return lambda engine, **kwargs: cls(process, engine=engine, **kwargs)

    # ---- what app.py uses --------------------------------------------------------------------------------------
    def start(self, warmup: bool = True) -> None:
        self._thread.start()
        self._send(("start", warmup, self.admit_quiet_s))

    @property
    def thread_ident(self) -> int | None:
        """The thread that receives the engine's messages (CPU accounting: scripts/bench_serve.py)."""
        return self._thread.ident

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def on_tokens(self, job: Job) -> None:
        """A request's callbacks stay here; the engine process makes its own."""
        return None

    def submit(self, jobs: list[Job]) -> None:
        with self._send_lock:  # (a cancel of these jobs is sent after them)
            with self._lock:
                if not self._accepting or self.state != "ready":
                    raise NotAccepting(self.state)
                waiting = self._depth()[0]
                if waiting + len(jobs) > self.max_queue:
                    raise QueueFull(waiting)
                items = []
                for job in jobs:
                    job.key = next(self._keys)
                    self._jobs[job.key] = job
                    mark(job, "queued")
                    items.append((job.key, job.label, request_fields(job.request), job.trace is not None))
                self._gauges()
            self._send(("submit", items))

    def cancel(self, job: Job) -> None:
        job.cancelled = True
        with self._send_lock:
            with self._lock:
                known = job.key in self._jobs
            if known:
                self._send(("cancel", job.key))

    def depth(self) -> tuple[int, int]:
        """(waiting, running) jobs: those in flight here, of which the engine last said these run."""
        with self._lock:
            return self._depth()

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False
            if self.state == "ready":
                self.state = "draining"
            if self._inflight is None:
                self._inflight = list(self._jobs.values())
        self._send(("stop",))

    def drain(self, grace_s: float) -> tuple[list[str], list[str]]:
        """As `Driver.drain`, run by the engine process; then the engine process is closed."""
        self.stop_accepting()
        inflight = self._inflight
        if self._send(("drain", grace_s)):
            self._drained.wait(grace_s + max(5.0, grace_s) + 30.0)  # the engine's own bound, and some
        with self._lock:
            self._closing = True
            left = list(self._jobs.values())
        self._fail(left, "the engine process did not finish its drain")
        self.process.close()
        if self._thread.is_alive():
            self._thread.join(timeout=10.0)
        with contextlib.suppress(OSError):
            self.conn.close()
        cancelled = {j.label for j in inflight if j.result is None or not j.result.ok}
        return sorted({j.label for j in inflight} - cancelled), sorted(cancelled)

    def wait_idle(self, timeout: float) -> bool:
        """`Driver.wait_idle` in the engine process."""
        return self.call(_wait_idle, timeout, timeout=timeout + 60.0)

    def call(self, fn, *args, timeout: float | None = None):
        """fn(host: EngineHost, *args) on a thread of the engine process (benchmarks, tests); its value."""
        key, done = next(self._keys), threading.Event()
        self._calls[key] = [done, None]
        if not self._send(("call", key, fn, args)):
            raise RuntimeError("the engine process is gone")
        if not done.wait(timeout):
            raise TimeoutError(f"{getattr(fn, '__name__', fn)} did not answer in {timeout} s")
        ok, value = self._calls.pop(key)[1]
        if not ok:
            raise RuntimeError(f"in the engine process: {value}")
        return value

    # ---- the receiving thread ----------------------------------------------------------------------------------
    def _receive(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "batch":
                self._on_batch(*message[1:])
            elif kind == "state":
                self._on_state(*message[1:])
            elif kind == "drained":
                self._drained.set()
            elif kind == "answer":
                call = self._calls.get(message[1])
                if call is not None:
                    call[1] = message[2:]
                    call[0].set()
        self._gone()

    def _on_batch(self, items, waiting: int, running: int, stats) -> None:
        now, tokens, metrics = time.perf_counter(), 0, self.metrics
        with self._lock:
            self._running = running
            got = []
            for key, kind, value in items:
                job = self._jobs.get(key) if kind in ("tokens", "trace") else self._jobs.pop(key, None)
                if job is None:
                    continue
                if kind == "trace":  # the engine process's stamps (its clock is this one: CLOCK_MONOTONIC)
                    for name, at in value.items():
                        mark(job, name, at)
                    continue
                got.append((job, kind, value))
            depth = self._depth()
        s = self.engine.stats
        s.compiles_after_warmup, s.spec_rounds, s.lookup_drafts, s.lookup_skips = stats
        try:
            with self._batch_context():  # one event-loop wake-up for the whole message
                for job, kind, value in got:
                    if kind == "tokens":
                        if job.cancelled:  # its next tokens cancel it in the engine (or already did)
                            continue
                        events = unpack_events(value)
                        if not job.first_token:
                            mark(job, "relayed")
                        tokens += len(events)
                        if metrics is not None:
                            metrics.delivery(job, now)
                        job.first_token = job.first_token or now
                        job.last_token = now
                        self._sink(job, "tokens", events)
                    else:
                        self._finish(job, value)
        except RuntimeError:  # the handlers' loop is closed: nobody reads these jobs any more (the drain ends them;
            for job, _, _ in got:  # this thread sends nothing: see _lock)
                job.cancelled = True
        finally:
            if metrics is not None:
                if tokens:
                    metrics.tokens.inc(tokens)
                metrics.depth(*depth)

    def _sink(self, job: Job, kind: str, value) -> None:
        try:
            job.sink(kind, value)
        except Exception:  # noqa: BLE001 - a handler that went away must not stop the others
            job.cancelled = True

    def _finish(self, job: Job, result: GenerateResult) -> None:
        job.result = result
        if self.metrics is not None:
            self.metrics.finished(job, result)
        self._sink(job, "done", result)

    def _on_state(self, state: str, error: str | None) -> None:
        with self._lock:
            if error:
                self.error = error
            if state == "ready" and not self._accepting:
                state = "draining"
            self.state = state

    def _gone(self) -> None:
        """The pipe closed: after `drain`, the end; otherwise the engine process died."""
        with self._lock:
            if self._closing:
                if self.state != "failed":
                    self.state = "stopped"
                return
        self.process.proc.join(5.0)  # its exit status (the pipe closes as it exits)
        with self._lock:
            status = _exit_status(self.process.proc.exitcode)
            self.error = f"the engine process {status}" + (f" ({self.error})" if self.error else "")
            self.state, self._accepting = "failed", False
            left = list(self._jobs.values())
        log.error("%s; failing %d requests in flight", self.error, len(left))
        self._fail(left, f"engine failed: {self.error}")
        self._drained.set()
        for call in list(self._calls.values()):
            call[1] = (False, self.error)
            call[0].set()

    def _fail(self, jobs: list[Job], message: str) -> None:
        with self._lock:
            for job in jobs:
                self._jobs.pop(job.key, None)
            depth = self._depth()
        try:
            with self._batch_context():
                for job in jobs:
                    self._finish(job, GenerateResult(error=ErrorCode.INTERNAL, message=message))
        except RuntimeError:
            pass
        if self.metrics is not None:
            self.metrics.depth(*depth)

    # ---- helpers -----------------------------------------------------------------------------------------------
    def _depth(self) -> tuple[int, int]:
        running = min(self._running, len(self._jobs))
        return len(self._jobs) - running, running

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.depth(*self._depth())

    def _send(self, message) -> bool:
        with self._send_lock:
            try:
                self.conn.send(message)
                return True
            except (OSError, ValueError):  # closed, or the engine process is gone (the receiver reports it)
                return False


def _wait_idle(host: EngineHost, timeout: float) -> bool:
    return host.driver.wait_idle(timeout)


def build_server(build: Callable[[], object], config, *, log_level: int = logging.INFO):
    """A `Server` whose engine runs in an engine process that `build()` builds there (picklable: a module-level
    function or a `functools.partial` of one). The tokenizer is the engine's."""
    from ds4jax.serving.app import Server

    process = EngineProcess(build, log_level=log_level)
    return Server(EngineView(process.info), process.info.tokenizer, config, driver=RemoteDriver.factory(process))
