"""The one thread that owns the `Engine` (it is not thread-safe): HTTP handlers submit `Job`s to a bounded queue,
the driver feeds them into one running `Engine.iterations` as slots free up, and each job's tokens and result go
back to its handler through `Job.sink` (called on the driver thread; the app hands them to its event loop). A
job's tokens of one engine iteration go in one ``("tokens", [TokenEvent, ...])`` call after it: one thread hop per
job and engine call instead of one per token (a decode call delivers up to steps-per-call tokens at once anyway);
a job's first token goes at once (time to first token). The engine thread is the server's critical path, so it
does no per-token work beyond buffering: the engine calls it once per request and engine call
(`Request.on_tokens`), yields once per iteration (`Engine.iterations`), metrics are counted per delivery
(`ServerMetrics.delivery`, the tokens once per hand-over) and engine stats sampled once per engine iteration.

* Admission is all-or-nothing per HTTP request (its n choices): `QueueFull` when the waiting jobs would exceed
  `max_queue`; the handler answers 429 with Retry-After.
* A burst is admitted together: when the engine thread wakes from idle to a job, it first waits until no job has
  arrived for `admit_quiet_s` (or `max_slots` wait, or `ADMIT_WAIT_CAP_S` passed), so the requests of a burst
  that the event loop is still reading go into the stream's first prefill. Starting with the first few instead
  puts the rest an engine call behind, with the first ones' decode calls between their prefill chunks (on the
  H200 at 32 clients the server's time to first token was 45 ms against the engine's 13 ms; on the CPU the
  stamps showed 2 feeds and 2 prefill chunks for a wave of 8 that the engine alone prefills in 1). A lone request
  waits `admit_quiet_s` once (1 ms by default, `ServerConfig.admit_quiet_ms`); a running stream takes every
  waiting job at each iteration as before.
* Only as many jobs as there are free slots are handed to the engine, so a cancelled job that still waits never
  reaches it, and the queue depth is the server's own (metrics).
* `cancel(job)`: a waiting job is dropped at once; a running one is cancelled at its next tokens (`on_tokens`
  returns False), which frees its slot (the engine resets it).
* `wait_idle(timeout)`: until the engine thread is between streams with nothing waiting; only then may another
  caller use the engine (a benchmark's engine-only passes): the thread still resets finished slots after it has
  handed their results over.
* `drain(grace_s)`: no new jobs; running and waiting ones may finish within the grace period, the rest are
  cancelled; returns which finished and which were cancelled (SIGTERM).
* Tracing (opt-in, `ServerConfig.trace`): a job with a `trace` dict gets a `time.monotonic()` stamp per step of
  its way to its first token (`TRACE_MARKS`; scripts/bench_serve.py reports the gaps between them), a few dict
  writes per request and none per token; a job without one (the default) costs one `is None` test per step.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time
from typing import Callable

from ds4jax.generation.requests import ErrorCode, FinishReason, GenerateResult, Request, TokenEvent

log = logging.getLogger("ds4jax.serve")


# The steps of a request's way to its first token, in order (`mark`): the client sends it, the server's handler
# starts ("received"), its jobs enter the driver's queue ("queued"; with an engine process: the front end sends
# them, and "arrived" is the engine process's queue), the engine thread's feed hands them to the engine
# ("handed"), the engine admits them into a slot and its prefill chunks ("admitted": the engine's queue_s after
# "handed"), the engine delivers the first token ("first_token"; with an engine process: the front end receives
# it, "relayed"), the event loop has written its first SSE event to the transport ("sse_written"), the client
# reads it. "sent" and "first_arrival" are the client's (the same CLOCK_MONOTONIC on Linux).
TRACE_MARKS = ("sent", "received", "queued", "arrived", "handed", "admitted", "first_token", "relayed",
               "sse_written", "first_arrival")


def mark(job, name: str, at: float | None = None) -> None:
    """Stamp `name` on a traced job (the first stamp wins); nothing for an untraced one."""
    trace = job.trace
    if trace is not None and name not in trace:
        trace[name] = time.monotonic() if at is None else at


ADMIT_WAIT_CAP_S = 0.02  # the longest an idle engine waits for a burst to settle (a steady trickle ends it)


class QueueFull(Exception):
    pass


class NotAccepting(Exception):
    pass


@dataclasses.dataclass(eq=False)
class Job:
    """One choice of one HTTP request. `sink(kind, value)`: ("tokens", [TokenEvent, ...]) per engine iteration
    that delivered some, then ("done", result)."""
    request: Request
    sink: Callable[[str, object], None]
    label: str = ""  # the HTTP request's id, for logs
    cancelled: bool = False
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    first_token: float = 0.0  # when its first tokens were handed over
    last_token: float = 0.0  # when its latest tokens were handed over
    result: GenerateResult | None = None
    key: int = -1  # its id between the front end and the engine process (engine_process.py)
    trace: dict[str, float] | None = None  # `TRACE_MARKS` stamps when traced (`mark`)


class Driver:
    QUEUED_MARK = "queued"  # the engine process's driver stamps "arrived" (its queue is the second one)

    def __init__(self, engine, *, max_queue: int, metrics=None, batch=contextlib.nullcontext,
                 admit_quiet_s: float = 0.0):
        """batch(): a context the driver hands an engine iteration's tokens of all jobs over in (the app's
        `Handoff.batch`: one event-loop wake-up for them all). admit_quiet_s: an idle engine starts once no job
        arrived for this long (see the module's docstring; 0: at the first job)."""
        self.engine, self.max_queue, self.metrics, self._batch_context = engine, max_queue, metrics, batch
        self.admit_quiet_s = float(admit_quiet_s)
        self._cv = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: set[Job] = set()
        self._accepting, self._stopping = True, False
        self._streaming = False  # the engine thread is inside `Engine.iterations`
        self._inflight: list[Job] | None = None  # what ran or waited when the server stopped accepting
        self.state = "starting"  # -> warming -> ready -> draining -> stopped (or failed)
        self.error: str | None = None
        self.warmup_report = None
        self._thread = threading.Thread(target=self._main, name="ds4jax-engine", daemon=True)
        self._batch: dict[Job, list[TokenEvent]] = {}  # this engine iteration's tokens per job (engine thread)

    # ---- the handlers' side ------------------------------------------------------------------------------------
    def start(self, warmup: bool = True) -> None:
        self._warmup = warmup
        self._thread.start()

    @property
    def thread_ident(self) -> int | None:
        """The engine thread's id (for CPU-time accounting: scripts/bench_serve.py)."""
        return self._thread.ident

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def submit(self, jobs: list[Job]) -> None:
        with self._cv:
            if not self._accepting or self.state != "ready":
                raise NotAccepting(self.state)
            if len(self._waiting) + len(jobs) > self.max_queue:
                raise QueueFull(len(self._waiting))
            self._waiting.extend(jobs)
            if jobs[0].trace is not None:
                now = time.monotonic()
                for job in jobs:
                    mark(job, self.QUEUED_MARK, now)
            self._gauges()
            self._cv.notify_all()  # the engine thread, not only a `wait_idle` caller

    def cancel(self, job: Job) -> None:
        with self._cv:
            job.cancelled = True
            if job in self._waiting:
                self._waiting.remove(job)
                self._gauges()
                self._done(job, GenerateResult(finish_reason=FinishReason.CANCELLED.value, error=ErrorCode.CANCELLED,
                                               message="cancelled before it started"))
                self._cv.notify_all()  # an idle engine waiting for a burst (`_gather`) looks again

    def wait_idle(self, timeout: float) -> bool:
        """Wait until the engine thread is between streams with no job waiting: True, or False after `timeout`
        seconds. The engine stays free until the next `submit`."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._streaming and not self._waiting, timeout)

    def depth(self) -> tuple[int, int]:
        """(waiting, running) jobs."""
        with self._cv:
            return len(self._waiting), len(self._running)

    def stop_accepting(self) -> None:
        """New submissions fail from now on (NotAccepting); what runs goes on. Remembers what was in flight."""
        with self._cv:
            self._accepting = False
            if self.state == "ready":
                self._set_state("draining")
            if self._inflight is None:
                self._inflight = list(self._waiting) + list(self._running)

    def drain(self, grace_s: float) -> tuple[list[str], list[str]]:
        """Stop accepting; let jobs finish for up to `grace_s`, then cancel the rest. -> (finished, cancelled)
        labels of the jobs that were in flight when the drain began."""
        self.stop_accepting()
        with self._cv:
            inflight = self._inflight
            deadline = time.monotonic() + grace_s
            while (self._waiting or self._running) and time.monotonic() < deadline:
                self._cv.wait(timeout=max(deadline - time.monotonic(), 0.0))
            for job in list(self._waiting) + list(self._running):
                job.cancelled = True
            for job in list(self._waiting):
                self._waiting.remove(job)
                self._done(job, GenerateResult(finish_reason=FinishReason.CANCELLED.value, error=ErrorCode.CANCELLED,
                                               message="the server is shutting down"))
            # running jobs are cancelled at their next token; wait (bounded) for the engine to report them
            end = time.monotonic() + max(5.0, grace_s)
            while self._running and time.monotonic() < end:
                self._cv.wait(timeout=0.1)
            self._stopping = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        # an HTTP request finished when all its choices did
        cancelled = {j.label for j in inflight if j.result is None or not j.result.ok}
        return sorted({j.label for j in inflight} - cancelled), sorted(cancelled)

    # ---- the engine thread -------------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            if self._warmup:
                self._set_state("warming")
                self.warmup_report = self.engine.warmup()
                log.info("warm-up done: %d programs, %d compilations",
                         len(self.warmup_report.programs), self.warmup_report.compiles)
            with self._cv:
                self._set_state("ready" if self._accepting else "draining")
            self._serve()
        except Exception as exc:  # noqa: BLE001 - a dead engine must show in /health, not kill the process silently
            log.exception("the engine thread failed")
            self.error = repr(exc)
            with self._cv:
                self._set_state("failed")
                self._accepting = False
                for job in list(self._waiting) + list(self._running):
                    self._done(job, GenerateResult(error=ErrorCode.INTERNAL, message=f"engine failed: {exc!r}"))
                self._waiting.clear()
                self._running.clear()
                self._cv.notify_all()
            return
        self._set_state("stopped")

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._stopping:
                    self._cv.wait()
                if self._stopping and not self._waiting:
                    return
                self._gather()
                self._streaming = True
            run: list[Job] = []  # index in this stream -> job
            try:
                for _ in self.engine.iterations([], on_result=lambda i, res: self._finished(run[i], res),
                                                feed=lambda: self._feed(run), waiting=self._has_waiting):
                    if self._batch:  # once per engine iteration, after it delivered all its tokens
                        self._flush()
                    self._after_iteration()
            finally:
                self._after_iteration()  # the results of the stream's last iteration
                with self._cv:
                    self._streaming = False
                    self._cv.notify_all()

    def _gather(self) -> None:
        """(Lock held, jobs waiting, the engine idle.) Wait while jobs keep arriving, at most `ADMIT_WAIT_CAP_S`:
        until none came for `admit_quiet_s`, the slots' worth waits, or the driver stops."""
        if self.admit_quiet_s <= 0:
            return
        slots = self.engine.tspec.max_slots
        deadline = time.monotonic() + ADMIT_WAIT_CAP_S
        while len(self._waiting) < slots and not self._stopping:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            seen = len(self._waiting)
            self._cv.wait(min(self.admit_quiet_s, left))  # a submit wakes it early
            if len(self._waiting) <= seen:  # quiet (or a cancel): what came is what the first prefill gets
                return

    def _after_iteration(self) -> None:
        """Once per engine iteration, after its hand-over (the engine process's driver sends one message then)."""

    def _set_state(self, state: str) -> None:
        self.state = state

    def _feed(self, run: list[Job]) -> list[Request]:
        """Before every engine iteration: sample the engine's stats, hand it as many waiting jobs as slots are
        free."""
        self._sample_stats()
        with self._cv:
            free = self.engine.tspec.max_slots - len(self._running)
            taken, now = [], None
            while self._waiting and len(taken) < free:
                job = self._waiting.popleft()
                if job.trace is not None:  # one stamp per feed: the jobs of one feed share it
                    now = now or time.monotonic()
                    mark(job, "handed", now)
                taken.append(job)
                self._running.add(job)
            self._gauges()
        run.extend(taken)
        return [job.request for job in taken]

    def _has_waiting(self) -> bool:
        """Whether a job waits for a slot (read without the lock: a stale answer only moves when a call ends)."""
        return bool(self._waiting)

    def _finished(self, job: Job, result: GenerateResult) -> None:
        with self._cv:
            self._running.discard(job)
            self._done(job, result)
            self._gauges()
            self._cv.notify_all()

    def _flush(self, jobs=None) -> None:
        """Hand the buffered tokens of `jobs` (default: all) to their handlers; their tokens are counted once."""
        now, handed, tokens = time.perf_counter(), [], 0
        delivery = self.metrics.delivery if self.metrics is not None else None
        try:
            with self._batch_context():
                for job in list(self._batch) if jobs is None else jobs:
                    events = self._batch.pop(job, None)
                    if not events:
                        continue
                    tokens += len(events)
                    if delivery is not None:
                        delivery(job, now)
                    job.first_token = job.first_token or now
                    job.last_token = now
                    handed.append(job)
                    job.sink("tokens", events)
        except Exception:  # noqa: BLE001 - the handlers' loop is closed: nobody reads these jobs any more
            for job in handed:
                job.cancelled = True  # its next token cancels it
        finally:
            if tokens and self.metrics is not None:
                self.metrics.tokens.inc(tokens)

    def _done(self, job: Job, result: GenerateResult) -> None:
        self._flush([job])  # its last tokens before its result
        job.result = result
        if job.trace is not None and "handed" in job.trace and "first_token" in job.trace:
            # the engine checked it right after the feed that handed it over, and admitted it queue_s later
            mark(job, "admitted", job.trace["handed"] + result.timings.queue_s)
        if self.metrics is not None:
            self.metrics.finished(job, result)
        try:
            job.sink("done", result)
        except Exception:  # noqa: BLE001 - a handler that went away must not stop the engine
            log.debug("job %s: its handler is gone", job.label)

    def on_tokens(self, job: Job) -> Callable[[list[TokenEvent]], bool]:
        """The `Request.on_tokens` of `job` (runs on this thread, once per engine call that gave it tokens): False
        cancels it."""

        def deliver(events: list[TokenEvent]) -> bool:
            if job.cancelled:
                return False
            held = self._batch.get(job)
            if held is None:
                self._batch[job] = events  # (the engine hands each call's list over and keeps no reference)
            else:
                held.extend(events)
            if events[0].index == 0:  # the first token goes at once: the rest of its iteration (a decode call)
                mark(job, "first_token")
                self._flush([job])  # would delay it by a whole call
            return True

        return deliver

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.depth(len(self._waiting), len(self._running))

    def _sample_stats(self) -> None:
        if self.metrics is not None:
            self.metrics.engine_stats(self.engine.stats)
