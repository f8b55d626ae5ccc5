"""`SSEResponse`: a streamed completion's body, written as its generator yields it, with the client's disconnect
delivered into the stream's own inbox.

Starlette's `StreamingResponse` watches for the disconnect (uvicorn speaks ASGI 2.3) with an anyio task group per
stream: a second task, a cancel scope and a cancellation that formats the current task's repr. On the 2-core CPU
the event loop's CPU per one-token streamed request was 610 us with it and is 344 us without (medians of five
runs, `scripts/profile_serve_front_end.py`, docs/benchmarks/serve_front_end_cpu.jsonl). Here one plain asyncio task
per stream waits for ``http.disconnect`` and puts `LEFT` into the stream's inbox, which the stream's generator
already waits on: the generator ends, its ``finally`` cancels the request's jobs (freeing their slots), and nothing
is cancelled by force.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from starlette.responses import Response

LEFT = (-1, "left", None)  # an inbox item: the client disconnected


class SSEResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], inbox: asyncio.Queue, headers: dict[str, str]):
        self.body_iterator, self.inbox = body, inbox
        self.status_code, self.background = 200, None
        self.init_headers(headers)

    async def __call__(self, scope, receive, send) -> None:
        watcher = asyncio.get_running_loop().create_task(watch(receive, self.inbox))
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            await self.body_iterator.aclose()  # (ended already, or stopped mid-way: its finally frees the slots)


async def watch(receive, inbox: asyncio.Queue) -> None:
    """Until the client disconnects (or the response completes: uvicorn then answers ``http.disconnect`` too), then
    `LEFT` into the inbox. Also the whole-response path's watcher (`app._whole`, after the request body is read)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    inbox.put_nowait(LEFT)
