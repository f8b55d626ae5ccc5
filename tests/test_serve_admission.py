"""How the serving driver starts an idle engine on a burst (`Driver._gather`), and the opt-in per-request stamps
(`ServerConfig.trace`, `driver.TRACE_MARKS`) that scripts/bench_serve.py reports: through a live server, and
across the engine process's pipe. No timing thresholds: the gather's quiet window is either far longer than the
test (so only arrivals can end it) or short and merely has to end."""

from __future__ import annotations

import threading
import time
import types

import httpx
import pytest

from ds4jax.generation.requests import GenerateResult, Request, TokenEvent
from ds4jax.io.tokenizer import ByteTokenizer
from ds4jax.serving import driver as driver_mod
from ds4jax.serving.config import ServerConfig
from ds4jax.serving.driver import TRACE_MARKS, Driver, Job
from serve_helpers import GUARD_S, live_server

TOK = ByteTokenizer()


def _engine(slots: int):
    return types.SimpleNamespace(tspec=types.SimpleNamespace(max_slots=slots))


def _job() -> Job:
    return Job(request=Request(prompt=[1]), sink=lambda kind, value: None)


def _gather_in_thread(driver: Driver) -> threading.Thread:
    """`driver._gather()` on a thread, returned once it waits (so what the test does next happens during the
    wait, not before it)."""
    waiting, wait = threading.Event(), driver._cv.wait

    def watched(timeout=None):
        waiting.set()
        return wait(timeout)

    def gather():
        with driver._cv:
            driver._gather()

    driver._cv.wait = watched
    thread = threading.Thread(target=gather, daemon=True)
    thread.start()
    deadline = time.monotonic() + GUARD_S  # (a gather that does not wait ends at once)
    while not waiting.wait(0.01) and thread.is_alive():
        assert time.monotonic() < deadline
    return thread


def test_an_idle_engine_waits_for_the_burst_until_the_slots_are_full(monkeypatch):
    """With a quiet window longer than the test, only arrivals end the wait: it ends when max_slots jobs wait,
    and the feed then hands all of them to the engine at once."""
    monkeypatch.setattr(driver_mod, "ADMIT_WAIT_CAP_S", GUARD_S)
    driver = Driver(_engine(3), max_queue=8, admit_quiet_s=GUARD_S)
    driver.state = "ready"
    driver.submit([_job()])
    thread = _gather_in_thread(driver)
    driver.submit([_job()])
    assert thread.is_alive()  # two of three slots' worth: it still waits
    driver.submit([_job()])
    thread.join(GUARD_S)
    assert not thread.is_alive()
    run = []
    assert len(driver._feed(run)) == 3 and len(run) == 3


def test_the_wait_ends_when_arrivals_stop_or_it_is_off(monkeypatch):
    monkeypatch.setattr(driver_mod, "ADMIT_WAIT_CAP_S", GUARD_S)
    for quiet in (0.001, 0.0):  # a short quiet window passes with no arrival; 0 does not wait at all
        driver = Driver(_engine(4), max_queue=8, admit_quiet_s=quiet)
        driver.state = "ready"
        driver.submit([_job()])
        thread = _gather_in_thread(driver)
        thread.join(GUARD_S)
        assert not thread.is_alive()


def test_a_cancel_or_a_stop_ends_the_wait(monkeypatch):
    monkeypatch.setattr(driver_mod, "ADMIT_WAIT_CAP_S", GUARD_S)
    driver = Driver(_engine(4), max_queue=8, admit_quiet_s=GUARD_S)
    driver.state = "ready"
    job = _job()
    driver.submit([_job(), job])
    thread = _gather_in_thread(driver)
    driver.cancel(job)  # the queue shrinks: nothing more is coming worth waiting for
    thread.join(GUARD_S)
    assert not thread.is_alive() and job.result is not None and not job.result.ok
    thread = _gather_in_thread(driver)
    with driver._cv:
        driver._stopping = True
        driver._cv.notify_all()
    thread.join(GUARD_S)
    assert not thread.is_alive()


def test_a_traced_request_is_stamped_in_order_and_an_untraced_one_not_at_all():
    with live_server(ServerConfig(model_name="tiny", trace=True)) as (server, base):
        jobs = []
        finished = server.metrics.finished
        server.metrics.finished = lambda job, result: (jobs.append(job), finished(job, result))
        body = {"prompt": "def f(", "max_tokens": 4, "temperature": 0, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=GUARD_S) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
    (job,) = jobs
    stamps = job.trace
    assert list(stamps) != [] and set(stamps) == {"received", "queued", "handed", "admitted", "first_token",
                                                  "sse_written"}
    order = [m for m in TRACE_MARKS if m in stamps]
    assert [stamps[m] for m in order] == sorted(stamps[m] for m in order)  # monotonic along the way
    untraced = _job()
    driver_mod.mark(untraced, "queued")
    assert untraced.trace is None


def test_the_engine_process_s_stamps_reach_the_front_end_s_job():
    """The engine process sends a traced job's stamps just before its result; the front end adds them to its own
    (a stamp it already has wins) and stamps "relayed" at the job's first tokens."""
    import multiprocessing

    from ds4jax.serving import engine_process

    ours, theirs = multiprocessing.Pipe()
    info = engine_process.EngineInfo(2, 64, 0, TOK.VOCAB_SIZE, 0, 1, TOK)
    driver = engine_process.RemoteDriver(types.SimpleNamespace(conn=ours, info=info), max_queue=2)
    driver.state = "ready"
    job = Job(request=Request(prompt=[1]), sink=lambda kind, value: None, trace={"received": 1.0})
    driver.submit([job])
    message = theirs.recv()
    assert message[0] == "submit" and message[1][0][3] is True  # the engine process is told to trace it
    driver._on_batch([(job.key, "tokens", engine_process.pack_events([TokenEvent(0, 5, 0)]))], 0, 1, (0, 0, 0, 0))
    engine_side = {"arrived": 2.0, "handed": 3.0, "first_token": 4.0, "received": 99.0}
    done = GenerateResult(tokens=[5], finish_reason="length")
    driver._on_batch([(job.key, "trace", engine_side), (job.key, "done", done)], 0, 0, (0, 0, 0, 0))
    assert job.result is done
    assert {k: job.trace[k] for k in ("received", "arrived", "handed", "first_token")} == {
        "received": 1.0, "arrived": 2.0, "handed": 3.0, "first_token": 4.0}
    assert job.trace["queued"] <= job.trace["relayed"]


@pytest.mark.parametrize("traced", [True, False])
def test_the_engine_process_host_sends_stamps_only_for_traced_jobs(traced):
    from ds4jax.serving import engine_process

    host = types.SimpleNamespace(_outbox_lock=threading.Lock(), _outbox=[], jobs={})
    job = Job(request=None, sink=None, trace={"handed": 1.0} if traced else None)
    host.jobs[7] = job
    sink = engine_process.EngineHost._sink(host, 7, job)
    sink("done", "result")
    kinds = [kind for _, kind, _ in host._outbox]
    assert kinds == (["trace", "done"] if traced else ["done"]) and 7 not in host.jobs
