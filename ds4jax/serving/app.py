"""The Starlette app of ``ds4jax serve``: OpenAI's completions and chat completions over one `Engine`.

Routes: POST /v1/completions, POST /v1/chat/completions (JSON, or SSE with ``stream: true``), GET /v1/models,
GET /health (200 once warm, 503 while warming or draining), GET /metrics (Prometheus text). With an API key every
route but /health needs ``Authorization: Bearer <key>``. Errors are OpenAI's JSON shape (`errors.py`).

Each HTTP request becomes n x prompts `Job`s for the `Driver`; their tokens come back on the event loop through a
per-request asyncio queue (`handoff.Handoff`: one loop wake-up per engine iteration, not per job). A client that
goes away (a closed stream, or a dropped connection while waiting for a whole response) cancels its jobs, which
frees their slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import sys
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ds4jax.generation.requests import MAX_FORCED, Budget, ErrorCode, Request
from ds4jax.serving import chat, logprobs as logprobs_mod, params as params_mod, sse
from ds4jax.serving.config import ServerConfig
from ds4jax.serving.driver import Driver, Job, NotAccepting, QueueFull, mark
from ds4jax.serving.errors import APIError, ServerCode
from ds4jax.serving.handoff import Handoff
from ds4jax.serving.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from ds4jax.serving.responses import Choice, Shape

log = logging.getLogger("ds4jax.serve")
# The engine thread waits for the GIL while the event loop encodes and writes tokens; at CPython's default switch
# interval (5 ms) each engine call could start that much late. 0.5 ms doubled the tokens/s of 32 streams over a
# fake engine of 10 ms calls on the 2-core CPU (scripts/bench_serve.py measures the real one).
SWITCH_INTERVAL_S = 0.0005
# A stream's headers (what sse-starlette sent): no caching, and no buffering by a proxy in front (nginx)
SSE_HEADERS = {"Cache-Control": "no-store", "Connection": "keep-alive", "X-Accel-Buffering": "no"}
PING = (-1, "ping", None)  # an inbox item: send a keep-alive comment


class Server:
    """The app's state: engine driver, limits, metrics. `app` is the ASGI application."""

    def __init__(self, engine, tokenizer, config: ServerConfig = ServerConfig(), driver=Driver):
        """driver(engine, max_queue=, metrics=, batch=, admit_quiet_s=): `Driver` runs the engine on a thread of this process;
        `engine_process.RemoteDriver.factory(...)` in an engine process (`engine` is then its `EngineView`)."""
        self.engine, self.tokenizer, self.config = engine, tokenizer, config
        self.metrics = ServerMetrics()
        self.metrics.slots.set(engine.tspec.max_slots)
        self.handoff = Handoff()  # the driver's items to the event loop
        self.driver = driver(engine, max_queue=config.max_queue, metrics=self.metrics, batch=self.handoff.batch,
                             admit_quiet_s=config.admit_quiet_ms / 1e3)
        self.limits = params_mod.Limits(
            model=config.model_name, max_context=engine.tspec.max_context,
            spec_positions=engine.k + 1 if engine.k else 0, max_tokens_cap=config.max_tokens_cap,
            default_max_tokens=config.default_max_tokens, max_n=config.max_n, vocab_size=engine.cfg.vocab_size,
            max_logprobs=engine.logprobs)
        self.token_text = logprobs_mod.TokenText(tokenizer)
        self.close_ids = chat.close_ids(tokenizer)
        self.stop_ids = () if tokenizer.eos_id is None else (tokenizer.eos_id,)
        self.shutdown_report: tuple[list[str], list[str]] | None = None
        self._streams: set[asyncio.Queue] = set()  # the inboxes of the open streams (event loop only)
        self._ping_timer: asyncio.TimerHandle | None = None  # armed while streams are open
        self._ping_loop: asyncio.AbstractEventLoop | None = None
        routes = [Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/metrics", self.metrics_route, methods=["GET"])]
        self.app = Starlette(routes=routes, lifespan=self._lifespan,
                             exception_handlers={APIError: self._api_error, HTTPException: self._http_error,
                                                 Exception: self._internal_error})

    # ---- lifespan ----------------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        before = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.driver.start(warmup=self.config.warmup)
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, self.shutdown, self.config.shutdown_grace_s)
            sys.setswitchinterval(before)

    def shutdown(self, grace_s: float) -> tuple[list[str], list[str]]:
        """Stop taking requests, give in-flight ones `grace_s`, cancel the rest; logs which (SIGTERM)."""
        if self.shutdown_report is None:
            finished, cancelled = self.driver.drain(grace_s)
            self.shutdown_report = finished, cancelled
            log.warning("shutdown: %d in-flight requests finished%s, %d cancelled%s", len(finished),
                        f" ({', '.join(finished)})" if finished else "", len(cancelled),
                        f" ({', '.join(cancelled)})" if cancelled else "")
        return self.shutdown_report

    # ---- guards ------------------------------------------------------------------------------------------------
    def _authorize(self, request: HTTPRequest) -> None:
        key = self.config.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        import hmac

        if not header.startswith("Bearer ") or not hmac.compare_digest(header[7:].encode(), key.encode()):
            raise APIError(ServerCode.UNAUTHORIZED, "missing or wrong API key (send 'Authorization: Bearer <key>')")

    async def _json_body(self, request: HTTPRequest):
        cap = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            raise APIError(ServerCode.BODY_TOO_LARGE, f"the body has {declared} bytes; the limit is {cap} "
                           "(--max-body-bytes)")
        chunks, size = [], 0
        async for chunk in request.stream():  # a body without Content-Length is counted as it comes
            size += len(chunk)
            if size > cap:
                raise APIError(ServerCode.BODY_TOO_LARGE, f"the body exceeds the limit of {cap} bytes "
                               "(--max-body-bytes)")
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(ServerCode.INVALID_JSON, f"the body is not valid JSON ({e})") from None
        except RecursionError:  # arrays / objects nested deeper than Python's parser recurses: the client's input
            raise APIError(ServerCode.INVALID_JSON, "the body nests arrays or objects too deeply") from None

    # ---- routes ------------------------------------------------------------------------------------------------
    async def health(self, request: HTTPRequest):
        state = self.driver.state
        waiting, running = self.driver.depth()
        body = {"status": state, "model": self.config.model_name, "waiting": waiting, "running": running,
                "slots": self.engine.tspec.max_slots}
        if self.driver.error:
            body["error"] = self.driver.error
        return self._answer("/health", JSONResponse(body, status_code=200 if state == "ready" else 503))

    async def models(self, request: HTTPRequest):
        self._authorize(request)
        data = [{"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "ds4jax",
                 "max_model_len": self.limits.max_context}]
        return self._answer("/v1/models", JSONResponse({"object": "list", "data": data}))

    async def metrics_route(self, request: HTTPRequest):
        self._authorize(request)
        self.metrics.ready.set(1 if self.driver.ready else 0)
        self.metrics.engine_stats(self.engine.stats)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def completions(self, request: HTTPRequest):
        return await self._generate(request, is_chat=False)

    async def chat_completions(self, request: HTTPRequest):
        return await self._generate(request, is_chat=True)

    # ---- generation --------------------------------------------------------------------------------------------
    async def _generate(self, request: HTTPRequest, *, is_chat: bool):
        received = time.monotonic() if self.config.trace else None
        route = "/v1/chat/completions" if is_chat else "/v1/completions"
        self._authorize(request)
        if not self.driver.ready:
            raise APIError(ServerCode.NOT_READY, f"the server is {self.driver.state}; retry when GET /health "
                           "says ready", headers={"Retry-After": str(self.config.retry_after_s)})
        p = params_mod.parse(await self._json_body(request), self.limits, self.tokenizer, is_chat=is_chat)
        if p.thinking_budget is not None and not 1 <= len(self.close_ids) <= MAX_FORCED:
            raise APIError(ServerCode.UNSUPPORTED_PARAMETER, f"thinking_budget: this tokenizer encodes </think> as "
                           f"{len(self.close_ids)} tokens; the engine can force at most {MAX_FORCED}",
                           param="thinking_budget")
        shape = Shape(is_chat, self.config.model_name, self.token_text if p.logprobs is not None else None)
        self.handoff.bind(asyncio.get_running_loop())
        inbox: asyncio.Queue = asyncio.Queue()
        choices, jobs = [], []
        for i, ids in enumerate(p.prompts):
            for j in range(p.n):
                index = len(choices)
                choices.append(Choice(index, self.tokenizer, p.stop, self.close_ids, p.thinking))
                job = Job(request=None, sink=self._sink(self.handoff, inbox, index), label=shape.id)
                if received is not None:
                    job.trace = {"received": received}
                job.request = self._engine_request(p, ids, j, job)
                jobs.append(job)
        try:
            self.driver.submit(jobs)
        except QueueFull:
            self.metrics.rejected.labels(ServerCode.QUEUE_FULL.value).inc()
            raise APIError(ServerCode.QUEUE_FULL, f"the queue is full ({self.config.max_queue} generations waiting); "
                           "retry later", headers={"Retry-After": str(self.config.retry_after_s)}) from None
        except NotAccepting as e:
            raise APIError(ServerCode.NOT_READY, f"the server is {e}", headers={
                "Retry-After": str(self.config.retry_after_s)}) from None
        prompt_tokens = sum(map(len, p.prompts))
        if p.stream:
            self.metrics.requests.labels(route, "200").inc()
            return sse.SSEResponse(self._events(shape, choices, jobs, inbox, p, prompt_tokens), inbox, SSE_HEADERS)
        return self._answer(route, await self._whole(request, shape, choices, jobs, inbox, prompt_tokens))

    def _engine_request(self, p, ids, choice: int, job: Job) -> Request:
        budget = None
        if p.thinking and p.thinking_budget is not None:
            budget = Budget(max_tokens=p.thinking_budget, close_ids=self.close_ids)
        return Request(prompt=list(ids), max_new_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k,
                       top_p=p.top_p, seed=p.seed_of(choice), stop_ids=self.stop_ids, stop_strings=p.stop,
                       on_tokens=self.driver.on_tokens(job), budget=budget, logprobs=p.logprobs)

    @staticmethod
    def _sink(handoff: Handoff, inbox: asyncio.Queue, index: int):
        def sink(kind: str, value) -> None:  # driver thread -> this request's event loop
            handoff.put(inbox, (index, kind, value))
        return sink

    async def _whole(self, request, shape: Shape, choices, jobs, inbox, prompt_tokens: int) -> Response:
        """The whole response once every choice has finished; a client that leaves first gets its jobs cancelled
        (their slots freed) as soon as it goes: `sse.watch` puts `LEFT` into the inbox this waits on (it polled
        `request.is_disconnected()` every 0.25 s before)."""
        pending = len(jobs)
        watcher = asyncio.get_running_loop().create_task(sse.watch(request.receive, inbox))
        try:
            while pending:
                index, kind, value = await inbox.get()
                if kind == "left":
                    log.info("%s: the client left; cancelling", shape.id)
                    return Response(status_code=499)
                if kind == "tokens":
                    choices[index].extend(value)
                else:
                    choices[index].finish(value)
                    pending -= 1
                    if not value.ok:
                        raise _result_error(value)
            return JSONResponse(shape.whole(choices, prompt_tokens))
        finally:
            watcher.cancel()
            for job in jobs:
                if job.result is None:
                    self.driver.cancel(job)

    async def _events(self, shape: Shape, choices, jobs, inbox, p, prompt_tokens: int):
        """The SSE body, in writes of whole events. Whatever has arrived when the loop looks (a decode call's tokens
        of each choice, or more while it was busy) goes out in one write (`_frames`), as at most one chunk per
        choice: its released text joined, the logprobs of the tokens that released it, and ``finish_reason`` when
        the choice ended. A choice's first token comes alone (the driver hands it over at once), so it is not held
        back. Every `ServerConfig.ping_s` the server-wide timer (`_ping`) adds a ``: ping`` comment.

        `SSEResponse` sends the writes as they are and puts `sse.LEFT` into the inbox when the client leaves: the
        generator returns, and the ``finally`` cancels its jobs (which frees their slots). (sse-starlette used cancel
        scopes per event and four tasks per stream, about a fifth of the event loop's CPU per token; Starlette's
        `StreamingResponse` a task group per stream, ~40 % of a one-token request's.)"""
        pending = len(jobs)
        traced = self.config.trace
        self._open_stream(inbox)
        try:
            if p.chat:
                yield _frames([shape.chunk_json(c.index, role=True) for c in choices])
            while pending:
                items = [await inbox.get()]
                while not inbox.empty():
                    items.append(inbox.get_nowait())
                touched: dict[int, None] = {}  # the choices with news, in order of arrival
                failed, ping = None, False
                for index, kind, value in items:
                    if kind == "ping":
                        ping = True
                        continue
                    if kind == "left":  # the client disconnected: nobody reads what would follow
                        return
                    touched[index] = None
                    if kind == "tokens":
                        choices[index].extend(value)
                        continue
                    pending -= 1
                    choices[index].finish(value)
                    if not value.ok:
                        failed = value
                        break
                out, written = [], []
                for i in touched:
                    chunk = _chunk(shape, choices[i])
                    if chunk is not None:
                        out.append(chunk)
                        written.append(i)
                if failed is not None:  # a failure mid-stream is an error event, never a normal end
                    out.append(json.dumps(_result_error(failed).body()))
                    yield _frames(out)
                    return
                if out or ping:
                    yield (_ping_comment() if ping else b"") + _frames(out)
                    if traced:  # resumed once the write went to the transport
                        for i in written:
                            mark(jobs[i], "sse_written")
            tail = [json.dumps(shape.usage_chunk(choices, prompt_tokens))] if p.include_usage else []
            yield _frames(tail + ["[DONE]"])
        finally:  # the client left (or the stream failed): cancel what still runs, which frees the slots
            self._streams.discard(inbox)
            for job in jobs:
                if job.result is None:
                    self.driver.cancel(job)

    # ---- keep-alive pings: one timer for all streams ---------------------------------------------------------
    def _open_stream(self, inbox: asyncio.Queue) -> None:
        self._streams.add(inbox)
        loop = asyncio.get_running_loop()
        if self.config.ping_s > 0 and (self._ping_timer is None or self._ping_loop is not loop):
            self._ping_loop, self._ping_timer = loop, loop.call_later(self.config.ping_s, self._ping)

    def _ping(self) -> None:
        """Every `ping_s` while streams are open: a ping item into each one's inbox (proxies close idle
        connections; a stream of a request waiting in the queue sends nothing else)."""
        self._ping_timer = None
        for inbox in self._streams:
            inbox.put_nowait(PING)
        if self._streams:
            self._ping_timer = self._ping_loop.call_later(self.config.ping_s, self._ping)

    # ---- answers -----------------------------------------------------------------------------------------------
    def _answer(self, route: str, response: Response) -> Response:
        self.metrics.requests.labels(route, str(response.status_code)).inc()
        return response

    async def _api_error(self, request: HTTPRequest, exc: APIError):
        self.metrics.requests.labels(request.url.path, str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def _http_error(self, request: HTTPRequest, exc: HTTPException):
        code = {404: ServerCode.NOT_FOUND, 405: ServerCode.METHOD_NOT_ALLOWED}.get(exc.status_code)
        err = APIError(code or ErrorCode.INVALID_REQUEST, f"{request.method} {request.url.path}: {exc.detail}")
        err.status = exc.status_code
        return await self._api_error(request, err)

    async def _internal_error(self, request: HTTPRequest, exc: Exception):
        log.exception("internal error on %s", request.url.path)
        err = APIError(ErrorCode.INTERNAL, f"internal error ({type(exc).__name__}); see the server log")
        return await self._api_error(request, err)


def _chunk(shape: Shape, choice) -> str | None:
    """The JSON of `choice`'s next chunk: what it released since its last one, with ``finish_reason`` once it
    ended well (a failed choice ends with an error event instead); None when there is nothing to say."""
    reasoning, content, entries = choice.take()
    finish = choice.finish_reason if choice.result is not None and choice.result.ok else None
    if not (reasoning or content or finish):
        return None
    return shape.chunk_json(choice.index, reasoning, content, finish_reason=finish, logprobs=shape.logprobs(entries))


def _frames(events: list[str]) -> bytes:
    """Several SSE events as one body write."""
    return "".join(f"data: {e}\n\n" for e in events).encode()


def _ping_comment() -> bytes:
    """A keep-alive SSE comment, as sse-starlette wrote it (clients ignore comments)."""
    return f": ping - {datetime.datetime.now(datetime.timezone.utc)}\n\n".encode()


def _result_error(result) -> APIError:
    code = result.error.value if result.error is not None else ErrorCode.INTERNAL.value
    return APIError(code, result.message or code)


def build_app(engine, tokenizer, config: ServerConfig = ServerConfig()):
    """(Server, ASGI app) for `engine`."""
    server = Server(engine, tokenizer, config)
    return server, server.app
