"""`ds4jax serve` through real clients: the official `openai` package and httpx against a live server on
127.0.0.1 (tests/serve_helpers.py). One server for the module; a second, tiny-queue one with an API key."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from ds4jax.serving.config import ServerConfig
from serve_helpers import live_server, metric
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
    assert [c.choices[0].finish_reason for c in chunks].count("length") == 1
    assert len(chunks) >= 3  # token by token, not one blob


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


def test_n_seed_and_logprobs(client):
    r = client.completions.create(model="tiny", prompt="x", max_tokens=5, temperature=1.0, n=2, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1] and r.usage.completion_tokens == 10
    again = client.completions.create(model="tiny", prompt="x", max_tokens=5, temperature=1.0, n=2, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # the seed decides
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, logprobs=2)
    assert e.value.body["code"] == "unsupported_parameter" and e.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], logprobs=True)


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
    r = httpx.post(base + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
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


def test_disconnect_cancels_and_frees_the_slot(served, monkeypatch):
    """Deterministic: the engine thread holds the request's first token until the handler has seen the client
    leave, so the cancellation surely happens mid-generation."""
    import threading
    import time

    server, base = served
    before = metric(httpx.get(base + "/metrics").text, "ds4jax_generations_total", outcome="cancelled")
    make = server.driver.on_token
    held = threading.Event()

    def on_token(job):
        deliver = make(job)

        def slow(event):
            if event.index == 0:
                held.set()
                deadline = time.monotonic() + 60
                while not job.cancelled and time.monotonic() < deadline:
                    time.sleep(0.01)
            return deliver(event)
        return slow

    monkeypatch.setattr(server.driver, "on_token", on_token)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "temperature": 0, "stream": True}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data: "))  # the role chunk; then leave
        assert held.wait(60)
    monkeypatch.undo()
    for _ in range(600):
        text = httpx.get(base + "/metrics").text
        if metric(text, "ds4jax_generations_total", outcome="cancelled") == before + 1:
            break
        time.sleep(0.05)
    assert metric(text, "ds4jax_generations_total", outcome="cancelled") == before + 1
    assert metric(text, "ds4jax_running") == 0 and server.driver.depth() == (0, 0)
    assert httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_sigterm_drain_names_what_it_cancelled():
    """What SIGTERM does (`server._Uvicorn.handle_exit`): stop accepting (health and new requests 503), give the
    in-flight request the grace period, cancel it when that runs out, and report it; its stream ends with an error
    event, not [DONE]."""
    import threading

    with live_server(ServerConfig(shutdown_grace_s=0.3)) as (server, base):
        make = server.driver.on_token
        held = threading.Event()

        def on_token(job):
            deliver = make(job)

            def slow(event):  # hold the first token until the drain cancels the request
                held.set()
                while not job.cancelled:
                    threading.Event().wait(0.01)
                return deliver(event)
            return slow

        server.driver.on_token = on_token
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
