"""64 concurrent streaming clients against one live server (4 engine slots, so most wait in its queue): mixed
lengths, every 10th client leaving mid-stream. Every other stream completes exactly once with the text a solo
request gets (nothing duplicated or lost), the leavers' slots are reclaimed, nothing compiles after warm-up.
Traffic goes to 127.0.0.1 only; the test is bounded in clients (64) and time (asyncio timeouts)."""

from __future__ import annotations

import asyncio
import json

import httpx

from ds4jax.serving.config import ServerConfig
from serve_helpers import live_server, metric

CLIENTS = 64
PROMPTS = ["def ", "import ", "class A", "# x"]
TIMEOUT_S = 600


async def stream_once(http: httpx.AsyncClient, prompt: str, max_tokens: int, leave_after: int | None):
    """-> (text, finish_reasons, saw_done) of one streamed completion; leave_after=k closes after k chunks."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text, reasons, done, chunks = "", [], False, 0
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            assert "error" not in event, event
            choice = event["choices"][0]
            text += choice["text"]
            if choice["finish_reason"]:
                reasons.append(choice["finish_reason"])
            chunks += 1
            if leave_after is not None and chunks >= leave_after:
                return text, reasons, None  # close the connection mid-stream
    return text, reasons, done


async def load(base: str):
    limits = httpx.Limits(max_connections=CLIENTS + 4)
    async with httpx.AsyncClient(base_url=base, timeout=TIMEOUT_S, limits=limits) as http:
        jobs = [(PROMPTS[i % len(PROMPTS)], 2 + (i * 7) % 15, 2 if i % 10 == 5 else None) for i in range(CLIENTS)]
        solo = {}
        for prompt, n, _ in jobs:  # what each request gives alone (greedy)
            if (prompt, n) not in solo:
                r = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0})
                solo[prompt, n] = r.json()["choices"][0]["text"]
        got = await asyncio.wait_for(asyncio.gather(*(stream_once(http, *j) for j in jobs)), TIMEOUT_S)
        return jobs, solo, got


def test_64_streaming_clients():
    with live_server(ServerConfig(model_name="tiny", max_queue=CLIENTS)) as (server, base):
        jobs, solo, got = asyncio.run(load(base))
        leavers = 0
        for (prompt, n, leave), (text, reasons, done) in zip(jobs, got):
            if leave is not None:
                leavers += 1
                continue
            assert done is True and reasons in (["length"], ["stop"]), (prompt, n, reasons)
            assert text == solo[prompt, n], (prompt, n)
        assert leavers == 6
        # the leavers were cancelled (or had finished); every slot and queue place is free again
        # (wait_idle: the engine thread still resets the slots after handing the last result over)
        assert server.driver.wait_idle(timeout=60), server.driver.depth()
        assert server.driver.depth() == (0, 0) and not server.engine._slots
        text = httpx.get(base + "/metrics").text
        assert metric(text, "ds4jax_running") == 0 and metric(text, "ds4jax_queue_depth") == 0
        finished = sum(metric(text, "ds4jax_generations_total", outcome=o) for o in ("length", "stop", "cancelled"))
        assert finished == CLIENTS + len(solo)
        assert metric(text, "ds4jax_compiles_after_warmup") == 0 and server.engine.stats.compiles_after_warmup == 0
        # the reclaimed slots serve again
        r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200
