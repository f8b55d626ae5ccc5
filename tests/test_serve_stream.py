"""The streaming contract of `ds4jax serve`, driven deterministically: `Server._events` reads items the driver
would hand over, queued by the test, so which tokens arrive together is fixed. What must hold: tokens of one
choice that are ready together go out as ONE chunk (their joined text, each token's logprobs in order,
``finish_reason`` on the chunk that ends the choice), a multi-byte character split across tokens comes out whole,
and stop strings cut the text exactly as in a whole response."""

from __future__ import annotations

import asyncio
import json
import types

import pytest

for _name in ("starlette",):
    pytest.importorskip(_name, reason="the serve extra is not installed (pip install 'ds4jax[serve]')")

from ds4jax.generation.requests import GenerateResult, TokenEvent, TokenLogprob
from ds4jax.io.tokenizer import ByteTokenizer
from ds4jax.serving.app import Server
from ds4jax.serving.config import ServerConfig
from ds4jax.serving.responses import Choice, Shape

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def server():
    """A `Server` that never starts: until it serves, it reads only these fields of its engine."""
    engine = types.SimpleNamespace(tspec=types.SimpleNamespace(max_slots=2, max_context=64), k=0, logprobs=3,
                                   cfg=types.SimpleNamespace(vocab_size=ByteTokenizer.VOCAB_SIZE))
    return Server(engine, TOK, ServerConfig(model_name="tiny"))


def _events(ids: list[int], start: int = 0, logprobs: bool = False) -> list[TokenEvent]:
    """Token events of `ids` (indices from `start`); with logprobs, token i's logprob is -(index + 1) / 8."""
    return [TokenEvent(0, t, start + i, TokenLogprob(-(start + i + 1) / 8, ((t, -(start + i + 1) / 8),))
                       if logprobs else None) for i, t in enumerate(ids)]


def _result(ids: list[int], finish: str = "length") -> GenerateResult:
    return GenerateResult(tokens=list(ids), finish_reason=finish, error=None, message="")


class _Stream:
    """One streamed completion's `Server._events`, fed batch by batch: `send(*items)` queues items (index, kind,
    value) as the driver would and runs the loop until the server waits for more; -> the events it wrote (the
    chunks as dicts, ``"[DONE]"`` as is). `ended`: the stream is over."""

    def __init__(self, server, *, logprobs: bool = False, stop=(), chat: bool = False):
        self.shape = Shape(chat, "tiny", server.token_text if logprobs else None)
        self.choice = Choice(0, TOK, stop, server.close_ids, False)
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.job = types.SimpleNamespace(result=None)
        params = types.SimpleNamespace(chat=chat, include_usage=False)
        self.gen = server._events(self.shape, [self.choice], [self.job], self.inbox, params, 0)
        self.loop = asyncio.new_event_loop()
        self.task, self.ended = None, False
        self.role = self.send() if chat else None

    async def _next(self):
        return await self.gen.__anext__()

    def send(self, *items) -> list:
        for item in items:
            if item[1] == "done":
                self.job.result = item[2]  # finished: the stream's cleanup has nothing to cancel
            self.inbox.put_nowait(item)
        out = []
        while not self.ended:
            self.task = self.task or self.loop.create_task(self._next())
            for _ in range(3):  # the wake-up of a queue getter, then the run up to its next await
                self.loop.run_until_complete(asyncio.sleep(0))
            if not self.task.done():
                break  # waiting for the next item
            task, self.task = self.task, None
            if isinstance(task.exception(), StopAsyncIteration):
                self.ended = True
                self.loop.close()
                break
            out += _parse(task.result())
        return out


def _parse(frame: bytes) -> list:
    """The data events of one body write: chunks as dicts, ``"[DONE]"`` as is (comments left out)."""
    assert isinstance(frame, bytes) and frame.endswith(b"\n\n")
    events = [e[len("data: "):] for e in frame.decode().split("\n\n") if e.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def _text(chunks) -> str:
    return "".join(c["choices"][0]["text"] for c in chunks)


def test_tokens_ready_together_are_one_chunk(server):
    """Fails if each token is its own chunk: 1 + 3 + 4 tokens in three batches are three chunks; the first
    token comes alone, the last batch and the result together end the choice in one chunk."""
    ids = TOK.encode("abcdefgh")
    s = _Stream(server)
    first = s.send((0, "tokens", _events(ids[:1])))
    middle = s.send((0, "tokens", _events(ids[1:4], 1)))
    last = s.send((0, "tokens", _events(ids[4:6], 4)), (0, "tokens", _events(ids[6:], 6)), (0, "done", _result(ids)))
    assert [len(first), len(middle), len(last)] == [1, 1, 2] and last[1] == "[DONE]" and s.ended
    assert [_text(x[:1]) for x in (first, middle, last)] == ["a", "bcd", "efgh"]
    assert [x[0]["choices"][0]["finish_reason"] for x in (first, middle, last)] == [None, None, "length"]


def test_logprobs_of_each_token_survive_coalescing(server):
    """Chat: a chunk of several tokens lists each token's logprobs entry, in order; a token whose text is held
    back (half a UTF-8 character) sends its entry with the chunk that releases its text."""
    ids = TOK.encode("ab\u00e9c")  # a, b, 0xC3, 0xA9, c
    assert len(ids) == 5
    s = _Stream(server, logprobs=True, chat=True)
    assert s.role[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    one = s.send((0, "tokens", _events(ids[:3], 0, logprobs=True)))  # a, b and half of é
    two = s.send((0, "tokens", _events(ids[3:], 3, logprobs=True)), (0, "done", _result(ids, "stop")))
    (c1,), (c2, done) = one, two
    assert done == "[DONE]"
    assert c1["choices"][0]["delta"] == {"content": "ab"}
    assert [e["logprob"] for e in c1["choices"][0]["logprobs"]["content"]] == [-1 / 8, -2 / 8]
    assert c2["choices"][0]["delta"] == {"content": "\u00e9c"} and c2["choices"][0]["finish_reason"] == "stop"
    entries = c2["choices"][0]["logprobs"]["content"]
    assert [e["logprob"] for e in entries] == [-3 / 8, -4 / 8, -5 / 8]
    assert [e["bytes"] for e in entries] == [[0xC3], [0xA9], [ord("c")]]


def test_split_character_and_stop_strings_across_batches(server):
    """The same tokens, coalesced into batches however they fall, give the whole response's text: a character
    split across batches comes out whole, a stop string split across batches cuts exactly."""
    text, stop = "x\u00e9ab|cd", ("b|c",)
    ids = TOK.encode(text)
    whole = Choice(0, TOK, stop, server.close_ids, False)
    for e in _events(ids):  # token by token
        whole.extend([e])
    whole.finish(_result(ids, "stop"))
    assert whole.content_text == "x\u00e9a"
    for cut in range(1, len(ids)):
        s = _Stream(server, stop=stop)
        chunks = s.send((0, "tokens", _events(ids[:cut])))
        chunks += s.send((0, "tokens", _events(ids[cut:], cut)), (0, "done", _result(ids, "stop")))
        assert chunks.pop() == "[DONE]" and s.ended, cut
        assert _text(chunks) == whole.content_text, cut
        assert all("\ufffd" not in c["choices"][0]["text"] for c in chunks), cut
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop" and len(chunks) <= 2, cut


def test_a_failure_mid_stream_ends_with_an_error_event(server):
    ids = TOK.encode("abc")
    s = _Stream(server)
    s.send((0, "tokens", _events(ids[:1])))
    failed = GenerateResult(tokens=ids, finish_reason="error", message="logits went non-finite")
    out = s.send((0, "tokens", _events(ids[1:], 1)), (0, "done", failed))
    assert _text(out[:1]) == "bc" and out[0]["choices"][0]["finish_reason"] is None
    assert out[1]["error"]["message"] == "logits went non-finite" and len(out) == 2 and s.ended  # no [DONE]


def test_the_driver_hands_over_the_first_token_at_once_and_the_rest_per_iteration(server):
    """`Driver.on_tokens` (the engine thread's callback, once per engine call): token 0 reaches the sink at once,
    later calls' tokens wait for the end of the engine iteration (`_flush`) and go in one hand-over, counted once
    per delivery."""
    from ds4jax.serving.driver import Driver, Job
    from ds4jax.serving.metrics import ServerMetrics

    metrics = ServerMetrics()
    driver = Driver(server.engine, max_queue=4, metrics=metrics)
    got = []
    job = Job(request=None, sink=lambda kind, value: got.append((kind, [e.index for e in value])))
    deliver = driver.on_tokens(job)
    events = _events(TOK.encode("abcdef"))
    assert deliver(events[:1]) and got == [("tokens", [0])]
    assert deliver(events[1:3]) and deliver(events[3:4]) and got == [("tokens", [0])]  # two calls, one iteration
    driver._flush()
    assert got == [("tokens", [0]), ("tokens", [1, 2, 3])]
    assert deliver(events[4:]) and got[-1] == ("tokens", [1, 2, 3])
    driver._flush()
    assert got[-1] == ("tokens", [4, 5])
    sample = metrics.registry.get_sample_value
    assert sample("ds4jax_generated_tokens_total") == 6
    assert sample("ds4jax_time_to_first_token_seconds_count") == 1 and sample("ds4jax_inter_token_seconds_count") == 2
    job.cancelled = True
    assert deliver(_events(TOK.encode("e"), 6)) is False


def test_handoff_wakes_the_loop_once_per_batch():
    """The engine thread's items reach their queues in order, with one loop wake-up (a self-pipe write) per
    batch, or per burst while a drain is pending; a closed loop raises."""
    from ds4jax.serving.handoff import Handoff

    loop = asyncio.new_event_loop()
    wakes = []
    schedule = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda callback, *args: (wakes.append(callback), schedule(callback, *args))[1]
    handoff = Handoff()
    handoff.bind(loop)
    a, b = asyncio.Queue(), asyncio.Queue()
    with handoff.batch():
        for item in range(3):
            handoff.put(a, item)
            handoff.put(b, -item)
        assert wakes == []
    assert len(wakes) == 1
    handoff.put(a, 3)
    handoff.put(a, 4)  # a drain is pending: no second wake-up
    assert len(wakes) == 1
    loop.run_until_complete(asyncio.sleep(0))
    assert [a.get_nowait() for _ in range(a.qsize())] == [0, 1, 2, 3, 4]
    assert [b.get_nowait() for _ in range(b.qsize())] == [0, -1, -2]
    handoff.put(a, 5)
    assert len(wakes) == 2
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()
    with pytest.raises(RuntimeError):
        handoff.put(a, 6)


def test_a_closed_loop_cancels_the_jobs_it_could_not_reach(server):
    """When the handlers' loop is gone (the hand-over raises), the driver cancels the jobs it handed tokens to:
    their next token returns False to the engine, which frees their slots."""
    from ds4jax.serving.driver import Driver, Job
    from ds4jax.serving.handoff import Handoff

    loop = asyncio.new_event_loop()
    handoff = Handoff()
    handoff.bind(loop)
    loop.close()
    driver = Driver(server.engine, max_queue=4, batch=handoff.batch)
    inbox: asyncio.Queue = asyncio.Queue()
    job = Job(request=None, sink=lambda kind, value: handoff.put(inbox, (0, kind, value)))
    deliver = driver.on_tokens(job)
    events = _events(TOK.encode("abc"), 1)  # not a first token: buffered until the iteration ends
    assert deliver(events[:1]) and not job.cancelled
    driver._flush()
    assert job.cancelled and deliver(events[1:]) is False


def test_an_idle_stream_gets_the_server_timer_s_ping():
    """Keep-alive: while a stream has nothing to send (its request waits for a slot, or a long prefill), the
    server-wide timer (`ServerConfig.ping_s`) puts a ``: ping`` comment into it; data goes on after it, and a
    closed stream leaves the timer's set."""
    engine = types.SimpleNamespace(tspec=types.SimpleNamespace(max_slots=2, max_context=64), k=0, logprobs=3,
                                   cfg=types.SimpleNamespace(vocab_size=ByteTokenizer.VOCAB_SIZE))
    server = Server(engine, TOK, ServerConfig(model_name="tiny", ping_s=0.05))
    inbox: asyncio.Queue = asyncio.Queue()
    choice = Choice(0, TOK, (), server.close_ids, False)
    gen = server._events(Shape(False, "tiny"), [choice], [types.SimpleNamespace(result=None)], inbox,
                         types.SimpleNamespace(chat=False, include_usage=False), 0)

    async def run():
        ping = await asyncio.wait_for(gen.__anext__(), 60)  # nothing was queued: only the timer can answer
        inbox.put_nowait((0, "tokens", _events(TOK.encode("a"))))
        data = await asyncio.wait_for(gen.__anext__(), 60)
        assert server._streams == {inbox}
        await gen.aclose()
        return ping, data

    loop = asyncio.new_event_loop()
    ping, data = loop.run_until_complete(run())
    loop.close()
    assert ping.startswith(b": ping - ") and ping.endswith(b"\n\n") and b"data:" not in ping
    assert _text(_parse(data)) == "a" and not server._streams


@pytest.mark.parametrize("chat", [False, True])
def test_a_chunk_without_logprobs_is_what_json_dumps_writes(chat):
    """`Shape.chunk_json` splices a chunk without logprobs from encoded strings (`responses._choice_json`): it
    must equal json.dumps of the chunk's dict, for any text (quotes, escapes, non-ASCII, a lone surrogate)."""
    shape = Shape(chat, "tiny")
    head = {"id": shape.id, "object": "chat.completion.chunk" if chat else "text_completion", "created": shape.created,
            "model": "tiny"}
    for reasoning, content, finish, role in [("", "", None, True), ("", 'a"b\\c\n\x01é€😀\ud800', None, False),
                                             ("think ✓", "", None, False), ("r", "c", "stop", False),
                                             ("", "", "length", False), ("", "x", None, True)]:
        if chat:
            delta = {"role": "assistant"} if role else {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if content or role:
                delta["content"] = content
            choice = {"index": 3, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 3, "text": content, "logprobs": None, "finish_reason": finish}
        got = shape.chunk_json(3, reasoning, content, finish_reason=finish, role=role)
        assert got == json.dumps({**head, "choices": [choice]})
