"""`ds4jax serve` through real clients: the official `openai` package and httpx against a live server on
127.0.0.1 (tests/serve_helpers.py). One server for the module; a second, tiny-queue one with an API key. Their
engines return up to `LOGPROBS` logprobs (`serve_helpers`)."""

from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai", reason="the test extra is not installed")

from ds4jax.io.tokenizer import ByteTokenizer
from ds4jax.serving.config import ServerConfig
from serve_helpers import GUARD_S, LOGPROBS, holding_first_token, live_server, metric
from small_engine import MAX_CONTEXT


@pytest.fixture(scope="module")
def served():
    with live_server(ServerConfig(model_name="tiny", max_queue=128)) as (server, base):
        yield server, base


@pytest.fixture()
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0)


def test_completion_and_stream_agree(client):
    whole = client.completions.create(model="tiny", prompt="def f(", max_tokens=8, temperature=0)
    assert whole.object == "text_completion" and len(whole.choices) == 1
    assert whole.usage.completion_tokens == 8 and whole.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model="tiny", prompt="def f(", max_tokens=8, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    # tokens that arrive together (a decode call's) share a chunk: tests/test_serve_stream.py pins which
    assert len(chunks) <= whole.usage.completion_tokens


def test_chat_thinking_off_and_on(client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    off = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
    m = off.choices[0].message
    assert m.role == "assistant" and m.content and getattr(m, "reasoning_content", None) is None
    on = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0,
                                        extra_body={"thinking": {"type": "enabled"}})
    m = on.choices[0].message
    assert m.model_extra["reasoning_content"] and m.content == ""  # a random model never closes the span itself
    assert on.usage.completion_tokens_details.reasoning_tokens == 6
    # a budget: the engine force-closes </think> after 3 tokens; what follows is the answer
    budget = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=16, temperature=0,
                                            extra_body={"thinking": {"type": "enabled", "budget_tokens": 3}})
    assert budget.usage.completion_tokens_details.reasoning_tokens == 3
    assert budget.usage.completion_tokens == 16 and budget.choices[0].message.content
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"thinking": {"type": "enabled", "budget_tokens": 3}})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    assert text == budget.choices[0].message.content
    assert reasoning == budget.choices[0].message.model_extra["reasoning_content"]
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].choices == []


def test_n_and_seed(client):
    r = client.completions.create(model="tiny", prompt="x", max_tokens=5, temperature=1.0, n=2, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1] and r.usage.completion_tokens == 10
    again = client.completions.create(model="tiny", prompt="x", max_tokens=5, temperature=1.0, n=2, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # the seed decides


def _chat_ids(entries) -> list[int]:
    """Token ids back from chat logprobs' bytes (the byte tokenizer: id = byte + 3; these tokens are all bytes)."""
    assert all(len(e.bytes) == 1 for e in entries)
    return [e.bytes[0] + ByteTokenizer.OFFSET for e in entries]


def test_logprobs_chat_and_completions_match_the_model(served, client):
    """Greedy chat logprobs equal log_softmax of forward_logits over the prompt and the continuation (1e-5);
    completions of the same prompt ids report the same values; the streams concatenate to the whole answers."""
    import jax
    import numpy as np

    import ds4jax
    from ds4jax.serving.chat import render_ids

    server, _ = served
    msgs = [{"role": "user", "content": "hi"}]
    new = 6
    whole = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=new, temperature=0, logprobs=True,
                                           top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == new
    ids = _chat_ids(content)
    prompt = render_ids(msgs, ByteTokenizer(), thinking=False)
    logits = ds4jax.forward_logits(server.engine.model, np.asarray([prompt + ids]))[0]
    ref = np.asarray(jax.nn.log_softmax(logits, axis=-1))[len(prompt) - 1: len(prompt) - 1 + new]
    np.testing.assert_allclose([e.logprob for e in content], ref[np.arange(new), ids], atol=1e-5)
    for e, row in zip(content, ref):
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token  # greedy: the best one
        np.testing.assert_allclose([t.logprob for t in e.top_logprobs], -np.sort(-row)[:3], atol=1e-5)
        assert e.token == bytes(e.bytes).decode("utf-8", errors="replace")
    stream = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=new, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    per_chunk = [c.choices[0].logprobs.content for c in stream if c.choices and c.choices[0].logprobs]
    streamed = [e for entries in per_chunk for e in entries]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    assert max(map(len, per_chunk)) > 1  # a decode call's tokens share a chunk, each with its own entry
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole.choices[0].message.content

    comp = client.completions.create(model="tiny", prompt=prompt, max_tokens=new, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert lp.token_logprobs == [e.logprob for e in content] and lp.tokens == [e.token for e in content]
    assert all(len(t) <= 3 and lp.tokens[i] in t for i, t in enumerate(lp.top_logprobs))  # 2 best + the sampled
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[-1] <= len(comp.choices[0].text)
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=new, temperature=0, logprobs=2,
                                            stream=True))
    joined = {k: [x for c in chunks if c.choices[0].logprobs for x in getattr(c.choices[0].logprobs, k)]
              for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert joined == {k: getattr(lp, k) for k in joined}


def test_logprobs_with_n_2(client):
    """Sampled choices each carry their own logprobs (one per token), whole and streamed alike."""
    kw = dict(model="tiny", prompt="x", max_tokens=4, temperature=1.0, n=2, seed=3, logprobs=1)
    whole = client.completions.create(**kw)
    by_index = {c.index: c.logprobs for c in whole.choices}
    assert all(len(v.token_logprobs) == 4 and all(x <= 0 for x in v.token_logprobs) for v in by_index.values())
    streamed = {0: [], 1: []}
    for c in client.completions.create(stream=True, **kw):
        if c.choices[0].logprobs:
            streamed[c.choices[0].index] += c.choices[0].logprobs.token_logprobs
    assert streamed == {i: v.token_logprobs for i, v in by_index.items()}
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                          temperature=1.0, n=2, seed=3, logprobs=True)
    assert [len(c.logprobs.content) for c in chat.choices] == [3, 3]
    assert all(c.logprobs.content[0].top_logprobs == [] for c in chat.choices)  # top_logprobs defaults to 0


def test_logprobs_off_are_rejected():
    """An engine without logprobs (``--max-logprobs 0``): asking is 400 unsupported_parameter; neutral values pass."""
    from ds4jax.serving import params
    from ds4jax.serving.errors import APIError

    limits = params.Limits(model="m", max_context=64, spec_positions=0, max_tokens_cap=8, default_max_tokens=4,
                           max_n=2, vocab_size=ByteTokenizer.VOCAB_SIZE, max_logprobs=0)
    chat = {"messages": [{"role": "user", "content": "x"}]}
    for body, is_chat, param in (({"prompt": "x", "logprobs": 1}, False, "logprobs"),
                                 ({"prompt": "x", "logprobs": 0}, False, "logprobs"),
                                 ({**chat, "logprobs": True}, True, "logprobs"),
                                 ({**chat, "top_logprobs": 2}, True, "top_logprobs")):
        with pytest.raises(APIError) as e:
            params.parse(body, limits, ByteTokenizer(), is_chat=is_chat)
        assert e.value.code == "unsupported_parameter" and e.value.param == param
    for body, is_chat in (({"prompt": "x", "logprobs": None}, False), ({**chat, "logprobs": False,
                                                                        "top_logprobs": 0}, True)):
        assert params.parse(body, limits, ByteTokenizer(), is_chat=is_chat).logprobs is None


def test_logprobs_bad_values(served):
    base = served[1]
    cases = [({"prompt": "x", "logprobs": LOGPROBS + 1}, "/v1/completions", "invalid_request", "logprobs"),
             ({"prompt": "x", "logprobs": True}, "/v1/completions", "invalid_request", "logprobs"),
             ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "/v1/chat/completions",
              "invalid_request", "top_logprobs"),
             ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
              "/v1/chat/completions", "invalid_request", "top_logprobs")]
    for body, route, code, param in cases:
        r = httpx.post(base + route, json={"max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["code"] == code, (body, r.text)
        assert r.json()["error"]["param"] == param


def test_http_errors(served):
    base = served[1]
    cases = [({"prompt": "x", "bogus": 1}, 400, "unknown_parameter", "bogus"),
             ({"prompt": "x", "temperature": -1}, 400, "invalid_request", "temperature"),
             ({"prompt": "x" * MAX_CONTEXT}, 400, "prompt_too_long", "prompt"),
             ({"prompt": "x", "max_tokens": MAX_CONTEXT}, 400, "prompt_too_long", "max_tokens"),
             ({"prompt": "x", "model": "other"}, 404, "model_not_found", "model")]
    for body, status, code, param in cases:
        r = httpx.post(base + "/v1/completions", json=body)
        assert r.status_code == status and r.json()["error"]["code"] == code, (body, r.text)
        assert r.json()["error"]["param"] == param
    # valid JSON whose "\ud800" escapes a lone surrogate, which no tokenizer can encode: was a 500
    r = httpx.post(base + "/v1/completions", content=b'{"prompt": "x\\ud800"}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "Unicode" in r.text, r.text
    r = httpx.post(base + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    # nested deeper than Python's parser recurses (200 KB, under the body limit): malformed input, not a 500
    nested = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = httpx.post(base + "/v1/completions", content=nested, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    r = httpx.post(base + "/v1/completions", content=b"x" * (2 << 20))
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    r = httpx.get(base + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert httpx.get(base + "/v1/models").json()["data"][0]["id"] == "tiny"


def test_auth_and_full_queue():
    with live_server(ServerConfig(api_key="s3cret", max_queue=2)) as (server, base):
        assert httpx.get(base + "/health").status_code == 200  # open, for probes
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.get(base + "/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        ok = {"Authorization": "Bearer s3cret"}
        assert httpx.get(base + "/v1/models", headers=ok).status_code == 200
        r = httpx.post(base + "/v1/completions", headers=ok, json={"prompt": "x", "max_tokens": 2, "n": 3})
        assert r.status_code == 429 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
        r = httpx.post(base + "/v1/completions", headers=ok, json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200
    finished, cancelled = server.shutdown_report
    assert cancelled == []


def test_greedy_server_equals_generate(served, capsys, monkeypatch):
    from ds4jax import cli
    from ds4jax.commands.generate import printable
    from ds4jax.io import default_model as default_module
    from ds4jax.io.tokenizer import ByteTokenizer

    server, base = served
    monkeypatch.setattr(default_module, "default_model", lambda dtype=None: server.engine.model)
    monkeypatch.setattr(default_module, "default_tokenizer", ByteTokenizer)
    monkeypatch.setattr(default_module, "default_config", lambda: server.engine.cfg)
    assert cli.main(["generate", "--prompt", "import os", "--max-new-tokens", "10", "-q"]) == 0
    out = capsys.readouterr().out
    r = httpx.post(base + "/v1/completions", json={"prompt": "import os", "max_tokens": 10, "temperature": 0})
    assert printable(r.json()["choices"][0]["text"]) + "\n" == out




def test_lookup_counters_reach_the_metrics(served):
    """Lookup drafting (on by default with speculation) counts its rounds in /metrics, as the engine does."""
    server, base = served
    assert server.engine.lookup == 3
    body = {"prompt": "abcabcabcabcabcabcabc", "max_tokens": 12, "temperature": 0}
    assert httpx.post(base + "/v1/completions", json=body).status_code == 200
    assert server.driver.wait_idle(GUARD_S)
    text = httpx.get(base + "/metrics").text
    stats = server.engine.stats
    assert metric(text, "ds4jax_speculative_lookup_drafts") == stats.lookup_drafts
    assert metric(text, "ds4jax_speculative_rounds_without_draft_steps") == stats.lookup_skips


def _driver_state(server) -> str:
    """What the engine thread is doing, for assertion messages: a timed-out wait then explains itself."""
    waiting, running = server.driver.depth()
    stats = server.engine.stats
    return (f"driver {server.driver.state} (error {server.driver.error}), {waiting} waiting, {running} running; "
            f"engine: {stats.prefill_steps} prefill calls, {stats.decode_calls}+{stats.spec_calls} decode calls, "
            f"{stats.tokens} tokens, {stats.completed} completed, {stats.cancelled} cancelled")


def test_disconnect_cancels_and_frees_the_slot(served, monkeypatch):
    """Deterministic: the engine thread holds the request's first token until the handler has seen the client
    leave, so the cancellation surely happens mid-generation."""
    import threading
    import time

    server, base = served
    idle = time.monotonic() + GUARD_S  # nothing of an earlier test may still run (its slot, its tokens)
    while server.driver.depth() != (0, 0) and time.monotonic() < idle:
        time.sleep(0.05)
    assert server.driver.depth() == (0, 0), f"an earlier test's jobs are still in the server: {_driver_state(server)}"
    before = metric(httpx.get(base + "/metrics").text, "ds4jax_generations_total", outcome="cancelled")
    make = server.driver.on_tokens
    held = threading.Event()
    jobs = []

    def on_tokens(job):
        jobs.append(job)
        return holding_first_token(make(job), job, held)

    def ended_without_a_token() -> bool:  # e.g. the request failed: say how, at once, rather than wait GUARD_S
        return bool(jobs) and jobs[0].result is not None and not held.is_set()

    monkeypatch.setattr(server.driver, "on_tokens", on_tokens)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "temperature": 0, "stream": True}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=GUARD_S) as r:
        assert r.status_code == 200
        # read the role chunk and stay connected until the first token is held: the line iterator is kept, since
        # a dropped one closes the connection (httpcore closes its stream on GeneratorExit), and a server that
        # saw the client leave before the request was admitted cancelled it before it started (a CI flake)
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                break
        deadline = time.monotonic() + GUARD_S
        while not held.wait(0.05) and not ended_without_a_token() and time.monotonic() < deadline:
            pass
        result = jobs[0].result if jobs else None
        assert held.is_set(), (f"no first token: {_driver_state(server)}; the request's result: "
                               f"{result and (result.error, result.message, result.tokens, result.finish_reason)}")
    # leaving the `with` closes the connection: the handler sees the client gone and cancels the held request
    monkeypatch.undo()
    deadline = time.monotonic() + GUARD_S
    while True:
        text = httpx.get(base + "/metrics").text
        if metric(text, "ds4jax_generations_total", outcome="cancelled") == before + 1 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert metric(text, "ds4jax_generations_total", outcome="cancelled") == before + 1, _driver_state(server)
    assert metric(text, "ds4jax_running") == 0 and server.driver.depth() == (0, 0), _driver_state(server)
    assert httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_a_whole_response_client_that_leaves_is_cancelled(served, monkeypatch):
    """Non-streamed: the client gives up (a read timeout closes the connection) while the engine holds the first
    token; `sse.watch` tells the handler at once, which cancels the job and frees its slot."""
    import threading
    import time

    server, base = served
    idle = time.monotonic() + GUARD_S
    while server.driver.depth() != (0, 0) and time.monotonic() < idle:
        time.sleep(0.05)
    before = metric(httpx.get(base + "/metrics").text, "ds4jax_generations_total", outcome="cancelled")
    make = server.driver.on_tokens
    held = threading.Event()
    monkeypatch.setattr(server.driver, "on_tokens", lambda job: holding_first_token(make(job), job, held))

    def leave():
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 20, "temperature": 0},
                       timeout=httpx.Timeout(GUARD_S, read=2.0))

    client = threading.Thread(target=leave)
    client.start()
    assert held.wait(GUARD_S), _driver_state(server)
    client.join(GUARD_S)
    monkeypatch.undo()
    deadline = time.monotonic() + GUARD_S
    while metric(httpx.get(base + "/metrics").text, "ds4jax_generations_total", outcome="cancelled") != before + 1:
        assert time.monotonic() < deadline, _driver_state(server)
        time.sleep(0.05)
    while server.driver.depth() != (0, 0):
        assert time.monotonic() < deadline, _driver_state(server)
        time.sleep(0.05)


def test_sigterm_drain_names_what_it_cancelled():
    """What SIGTERM does (`server._Uvicorn.handle_exit`): stop accepting (health and new requests 503), give the
    in-flight request the grace period, cancel it when that runs out, and report it; its stream ends with an error
    event, not [DONE]."""
    import threading

    with live_server(ServerConfig(shutdown_grace_s=0.3)) as (server, base):
        make = server.driver.on_tokens
        held = threading.Event()

        def on_tokens(job):
            deliver = make(job)

            def slow(events):  # hold the first token until the drain cancels the request
                held.set()
                while not job.cancelled:
                    threading.Event().wait(0.01)
                return deliver(events)
            return slow

        server.driver.on_tokens = on_tokens
        events = []

        def client():
            body = {"prompt": "x", "max_tokens": 20, "stream": True}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
                events.extend(line for line in r.iter_lines() if line.startswith("data: "))

        t = threading.Thread(target=client)
        t.start()
        assert held.wait(60)
        server.driver.stop_accepting()
        assert httpx.get(base + "/health").status_code == 503
        r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready" and "retry-after" in r.headers
        finished, cancelled = server.shutdown(server.config.shutdown_grace_s)
        t.join(60)
        assert finished == [] and len(cancelled) == 1 and cancelled[0].startswith("cmpl-")
        last = json.loads(events[-1][len("data: "):])
        assert last["error"]["code"] == "cancelled" and "data: [DONE]" not in events


def test_wait_idle_waits_for_the_engine_thread(served, monkeypatch):
    """`Driver.wait_idle` is False while a generation runs and True once the engine thread has left its stream
    (it still resets slots after the last result went out); then the engine is free for another caller, as
    scripts/bench_serve.py's engine-only passes use it."""
    import threading

    from ds4jax import Request

    server, base = served
    make = server.driver.on_tokens
    held, release = threading.Event(), threading.Event()

    def on_tokens(job):
        deliver = make(job)

        def slow(events):
            held.set()
            release.wait(60)
            return deliver(events)
        return slow

    monkeypatch.setattr(server.driver, "on_tokens", on_tokens)
    done = []
    t = threading.Thread(target=lambda: done.append(httpx.post(base + "/v1/completions", timeout=60, json={
        "prompt": "x", "max_tokens": 3, "temperature": 0}).status_code))
    t.start()
    assert held.wait(60)
    assert server.driver.wait_idle(0.05) is False
    release.set()
    t.join(60)
    assert done == [200] and server.driver.wait_idle(60)
    assert server.engine.generate([Request(prompt=[5, 6, 7], max_new_tokens=2)])[0].ok


def test_a_stream_in_flight_at_sigterm_finishes_within_the_grace_period(monkeypatch):
    """SIGTERM (`_Uvicorn.handle_exit`) stops new requests, but a stream already running gets the grace period to
    finish: it ends with [DONE] and the shutdown reports it finished. (sse-starlette's exit watcher cancelled every
    stream at the signal, the grace period notwithstanding.)"""
    import signal
    import threading
    import time

    from ds4jax.serving import server as server_mod

    made = []
    init = server_mod._Uvicorn.__init__

    def record(self, *args, **kwargs):  # the test needs the uvicorn server to signal it
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(server_mod._Uvicorn, "__init__", record)
    with live_server(ServerConfig(shutdown_grace_s=60)) as (server, base):
        flush = server.driver._flush

        def slow(jobs=None):  # each engine iteration's hand-over waits a little: the signal comes mid-stream
            threading.Event().wait(0.05)
            flush(jobs)

        server.driver._flush = slow
        lines = []
        body = {"prompt": "x", "max_tokens": 40, "temperature": 0, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if len(lines) == 2:
                        made[0].handle_exit(signal.SIGTERM, None)
        assert len(lines) > 3 and lines[-1] == "data: [DONE]", lines[-2:]
        assert json.loads(lines[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
        deadline = time.monotonic() + 60
        while server.shutdown_report is None and time.monotonic() < deadline:
            threading.Event().wait(0.05)
        finished, cancelled = server.shutdown_report
        assert len(finished) == 1 and cancelled == []
