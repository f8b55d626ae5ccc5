"""`ds4jax.serving.sse.SSEResponse` on its own (fake ASGI receive / send): the body goes out as the generator yields
it, a disconnect reaches the stream's inbox as `LEFT` and ends the generator (whose ``finally`` frees the slots),
and the streamed completion route answers with it (not Starlette's StreamingResponse and its task group)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("starlette", reason="the serve extra is not installed (pip install 'ds4jax[serve]')")

from ds4jax.serving import sse  # noqa: E402


def _run(body, inbox, receive):
    sent = []

    async def send(message):
        sent.append(message)
        await asyncio.sleep(0)

    async def main():
        await sse.SSEResponse(body, inbox, {"Cache-Control": "no-store"})({"type": "http"}, receive, send)

    asyncio.run(main())
    return sent


def test_the_body_goes_out_as_written_then_ends():
    async def body():
        yield b"data: 1\n\n"
        yield b"data: [DONE]\n\n"

    async def receive():  # the client stays
        await asyncio.Event().wait()

    sent = _run(body(), asyncio.Queue(), receive)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert [m["body"] for m in sent[1:]] == [b"data: 1\n\n", b"data: [DONE]\n\n", b""]
    assert [m["more_body"] for m in sent[1:]] == [True, True, False]


def test_a_disconnect_ends_the_stream_through_its_inbox():
    closed = []

    def run():
        inbox: asyncio.Queue = asyncio.Queue()

        async def body():  # waits on its inbox, as app.Server._events does
            try:
                yield b"data: first\n\n"
                while True:
                    item = await inbox.get()
                    if item is sse.LEFT:
                        return
                    yield b"data: more\n\n"
            finally:
                closed.append(True)

        async def receive():  # the client leaves after the first event
            await asyncio.sleep(0.01)
            return {"type": "http.disconnect"}

        return _run(body(), inbox, receive)

    sent = run()
    assert closed == [True]
    assert [m.get("body") for m in sent[1:]] == [b"data: first\n\n", b""]


def test_streamed_completions_answer_with_it(monkeypatch):
    """The dispatch itself: a streamed request through the app goes through SSEResponse."""
    import httpx
    from fake_engine import FakeEngine
    from serve_helpers import live_server

    calls = []
    call = sse.SSEResponse.__call__

    async def counted(self, scope, receive, send):
        calls.append(scope["path"])
        await call(self, scope, receive, send)

    monkeypatch.setattr(sse.SSEResponse, "__call__", counted)
    with live_server(engine=FakeEngine(delay_s=0.001)) as (server, base):
        body = {"model": server.config.model_name, "prompt": "hi", "max_tokens": 3, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        whole = httpx.post(base + "/v1/completions", json=dict(body, stream=False), timeout=30)
    assert lines[-1] == "data: [DONE]" and whole.status_code == 200
    assert calls == ["/v1/completions"]  # the streamed one only
