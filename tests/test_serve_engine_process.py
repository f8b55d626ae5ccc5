"""`ds4jax serve --engine-process` (ds4jax/serving/engine_process.py): the engine in a process of its own, HTTP in
this one. One two-process server on the small engine for the module: its whole and streamed answers are the
engine's greedy tokens, and a client that leaves mid-stream is cancelled in the engine process, which frees its
slot. What ends a server runs on `fake_engine` (no JAX: its engine process is up in about a second): a killed
engine process (/health "failed", the request in flight ends with an error), a drain (what finishes within the
grace period finishes, the rest is cancelled, the engine process exits), the front end's death (the engine
process follows). The wire format and the front end's admission are checked without any process."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from ds4jax.generation.requests import GenerateResult, Request, TokenEvent, TokenLogprob
from ds4jax.io.tokenizer import ByteTokenizer
from ds4jax.serving import engine_process
from ds4jax.serving.config import ServerConfig
from ds4jax.serving.driver import Job, NotAccepting, QueueFull
from fake_engine import FakeEngine
from serve_helpers import GUARD_S, holding_first_token, live_server, metric

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def served():
    with live_server(ServerConfig(model_name="tiny", max_queue=8), engine_process=True) as (server, base):
        yield server, base


# ---- run in the engine process (RemoteDriver.call) -------------------------------------------------------------------
def _greedy(host, prompt: list[int], n: int) -> list[int]:
    assert host.driver.wait_idle(GUARD_S)  # the engine is free between streams
    return host.engine.generate([Request(prompt=prompt, max_new_tokens=n, stop_ids=(TOK.eos_id,))])[0].tokens


def _lookup_counts(host) -> tuple[int, int]:
    return host.engine.stats.lookup_drafts, host.engine.stats.lookup_skips


def _hold_first_tokens(host) -> None:
    """A job's first tokens wait in the engine thread until the job is cancelled (the front end's cancel reached
    the engine process): the cancellation surely happens mid-generation."""
    held = host.held = threading.Event()
    make = type(host.driver).on_tokens

    def on_tokens(job):
        return holding_first_token(make(host.driver, job), job, held)

    host.driver.on_tokens = on_tokens


def _held(host) -> bool:
    return host.held.is_set()


def _release(host) -> None:
    del host.driver.on_tokens


# ---- the small engine behind the front end -----------------------------------------------------------------------
def _stream(base: str, body: dict) -> list[str]:
    with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=GUARD_S) as r:
        assert r.status_code == 200
        return [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]


def test_whole_and_streamed_answers_are_the_engine_s_greedy_tokens(served):
    server, base = served
    assert isinstance(server.driver, engine_process.RemoteDriver) and server.driver.process.proc.is_alive()
    prompt = TOK.encode("def f(", add_bos=True)
    want = server.driver.call(_greedy, prompt, 12, timeout=GUARD_S)
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
    whole = httpx.post(base + "/v1/completions", json=body, timeout=GUARD_S).json()
    assert whole["choices"][0]["text"] == TOK.decode(want) and whole["usage"]["completion_tokens"] == len(want)
    events = _stream(base, body)
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == TOK.decode(want)
    # the engine process's lookup-drafting counters reach the front end's /metrics (lookup is on by default)
    counts = server.driver.call(_lookup_counts, timeout=GUARD_S)
    text = httpx.get(base + "/metrics").text
    assert (metric(text, "ds4jax_speculative_lookup_drafts"),
            metric(text, "ds4jax_speculative_rounds_without_draft_steps")) == counts


def test_a_client_that_leaves_is_cancelled_in_the_engine_process(served):
    server, base = served
    before = metric(httpx.get(base + "/metrics").text, "ds4jax_generations_total", outcome="cancelled")
    server.driver.call(_hold_first_tokens, timeout=GUARD_S)
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "temperature": 0, "stream": True}
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=GUARD_S) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept: a dropped iterator would close the connection early
            next(line for line in lines if line.startswith("data: "))  # the role chunk
            deadline = time.monotonic() + GUARD_S
            while not server.driver.call(_held, timeout=GUARD_S) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert server.driver.depth() == (0, 1)
        # the connection closed: the front end cancels, the engine process's held job sees it and ends
        deadline = time.monotonic() + GUARD_S
        while time.monotonic() < deadline:
            text = httpx.get(base + "/metrics").text
            if metric(text, "ds4jax_generations_total", outcome="cancelled") == before + 1:
                break
            time.sleep(0.05)
    finally:
        server.driver.call(_release, timeout=GUARD_S)
    assert metric(text, "ds4jax_generations_total", outcome="cancelled") == before + 1
    assert metric(text, "ds4jax_running") == 0 and server.driver.depth() == (0, 0)
    r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=GUARD_S)
    assert r.status_code == 200  # the slot serves again


# ---- what ends a server: the fake engine -----------------------------------------------------------------------------
def test_a_killed_engine_process_fails_health_and_the_request_in_flight():
    with live_server(ServerConfig(), build=functools.partial(FakeEngine, delay_s=0.05)) as (server, base):
        body = {"prompt": "x", "max_tokens": 50, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=GUARD_S) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # a first token: the request runs
            os.kill(server.driver.process.pid, signal.SIGKILL)
            last = [line for line in lines if line.startswith("data: ")][-1]
        error = json.loads(last[len("data: "):])["error"]
        assert error["code"] == "internal" and "killed by signal 9" in error["message"]
        health = httpx.get(base + "/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert "killed by signal 9" in health.json()["error"]
        r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        text = httpx.get(base + "/metrics").text
        assert metric(text, "ds4jax_generations_total", outcome="internal") == 1
        assert metric(text, "ds4jax_running") == 0 and server.driver.depth() == (0, 0)


def test_drain_finishes_what_it_can_cancels_the_rest_and_ends_the_engine_process():
    """SIGTERM's drain (`server._Uvicorn.handle_exit`, then the lifespan's shutdown) with two streams in flight:
    a short one finishes within the grace period, a long one (6 s of tokens) is cancelled when it ends."""
    with live_server(ServerConfig(shutdown_grace_s=2), build=functools.partial(FakeEngine, delay_s=0.1)) as (
            server, base):
        got: dict[int, list[str]] = {}
        started = {n: threading.Event() for n in (60, 5)}

        def client(n: int) -> None:
            with httpx.stream("POST", base + "/v1/completions", json={"prompt": "x", "max_tokens": n, "stream": True},
                              timeout=GUARD_S) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        got.setdefault(n, []).append(line[len("data: "):])
                        started[n].set()

        threads = [threading.Thread(target=client, args=(n,)) for n in (60, 5)]
        for t, n in zip(threads, (60, 5)):
            t.start()
            assert started[n].wait(GUARD_S)
        server.driver.stop_accepting()
        assert httpx.get(base + "/health").json()["status"] == "draining"
        assert httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 503
        finished, cancelled = server.shutdown(server.config.shutdown_grace_s)
        for t in threads:
            t.join(GUARD_S)
        short, long = (json.loads(got[n][0])["id"] for n in (5, 60))
        assert finished == [short] and cancelled == [long]
        assert got[5][-1] == "[DONE]" and json.loads(got[60][-1])["error"]["code"] == "cancelled"
        assert server.driver.process.proc.exitcode == 0 and server.driver.state == "stopped"


def test_the_engine_process_ends_with_its_front_end(tmp_path):
    """A front end killed outright (no drain, no exit hook) leaves no engine process behind."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = ("import sys, time\nfrom fake_engine import FakeEngine\nfrom ds4jax.serving.engine_process import "
            "EngineProcess\nif __name__ == '__main__':\n    p = EngineProcess(FakeEngine)\n    print(p.pid, "
            "flush=True)\n    time.sleep(600)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, *sys.path])}
    front = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        engine_pid = int(front.stdout.readline())
    finally:
        front.kill()
        front.wait(GUARD_S)

    def running() -> bool:  # an exited child of a dead parent may linger as a zombie until init reaps it
        try:
            with open(f"/proc/{engine_pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + GUARD_S
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running()


# ---- no process ------------------------------------------------------------------------------------------------------
def test_events_and_requests_cross_the_pipe_unchanged():
    events = [TokenEvent(0, 7, 4, TokenLogprob(-0.5, ((7, -0.5), (9, -1.0)))), TokenEvent(0, 8, 5, TokenLogprob(-0.1))]
    assert engine_process.unpack_events(engine_process.pack_events(events)) == events
    plain = [TokenEvent(0, 7, 0), TokenEvent(0, 8, 1)]
    assert engine_process.unpack_events(engine_process.pack_events(plain)) == plain
    request = Request(prompt=[1, 2], max_new_tokens=3, temperature=0.5, seed=9, stop_strings=("x",), logprobs=2,
                      on_tokens=print)
    assert Request(**engine_process.request_fields(request), on_tokens=print) == request


def test_the_front_end_admits_by_its_own_count_of_waiting_jobs():
    """Waiting = in flight here less what the engine last reported running; more than max_queue -> QueueFull;
    after stop_accepting -> NotAccepting. (A pipe with nobody at the other end stands in for the engine process.)"""
    import multiprocessing
    import types

    ours, theirs = multiprocessing.Pipe()
    info = engine_process.EngineInfo(2, 64, 0, TOK.VOCAB_SIZE, 0, 1, TOK)
    driver = engine_process.RemoteDriver(types.SimpleNamespace(conn=ours, info=info), max_queue=2)
    driver.state = "ready"
    job = lambda: Job(request=Request(prompt=[1]), sink=lambda kind, value: None)  # noqa: E731
    first = [job(), job()]
    driver.submit(first)
    assert driver.depth() == (2, 0)
    with pytest.raises(QueueFull):
        driver.submit([job()])
    driver._on_batch([], 0, 2, (0, 0, 0, 0))  # the engine runs both (stats: compiles, rounds, lookup counts)
    assert driver.depth() == (0, 2)
    driver.submit([job(), job()])
    driver._on_batch([(first[0].key, "done", GenerateResult(error=None, finish_reason="length"))], 2, 1, (0, 0, 0, 0))
    assert driver.depth() == (2, 1) and first[0].result.ok
    driver.stop_accepting()
    with pytest.raises(NotAccepting):
        driver.submit([job()])
    assert [theirs.recv()[0] for _ in range(3)] == ["submit", "submit", "stop"]
