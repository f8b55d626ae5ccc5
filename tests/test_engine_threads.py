"""The Engine's thread and callback contract (docs/errors.md): calls from several threads run one after another,
each caller getting its own results and callbacks; a call from inside a call on the same thread raises
`EngineBusy` at once; an exception in a user callback (`on_token`, `on_result`, a stream's consumer) ends only
its own request (cancelled, the exception named), and every other request gets the tokens it gets alone."""

from __future__ import annotations

import threading

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ds4jax import ErrorCode, Request
from ds4jax.errors import EngineBusy
from small_engine import one_layer_model, small_engine

PROMPTS = [list(range(3, 3 + n)) for n in (4, 9, 6, 12, 5)]
MAX_NEW = (7, 5, 9, 6, 8)
SPECULATIVE = (0, None, 0, None, 0)  # plain and speculative rows in one batch


def make(i: int, **kw) -> Request:
    return Request(prompt=PROMPTS[i], max_new_tokens=MAX_NEW[i], speculative=SPECULATIVE[i], **kw)


@pytest.fixture(scope="module")
def served():
    engine = small_engine(one_layer_model())
    engine.warmup()
    return engine, [engine.generate([make(i)])[0].tokens for i in range(len(PROMPTS))]


class Boom(Exception):
    pass


def raise_at(n: int):
    def on_token(ev):
        if ev.index == n:
            raise Boom(f"token {n}")
    return on_token


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.lists(st.sampled_from(["none", "on_token", "on_result"]), min_size=len(PROMPTS), max_size=len(PROMPTS)),
       st.integers(0, 4))
def test_a_raising_callback_affects_only_its_request(served, modes, at):
    engine, alone = served
    reqs = [make(i, on_token=raise_at(at)) if m == "on_token" else make(i) for i, m in enumerate(modes)]
    seen = []

    def on_result(i, res):
        seen.append(i)
        if modes[i] == "on_result":
            raise Boom(f"result {i}")

    results = engine.generate(reqs, on_result=on_result)
    assert sorted(seen) == list(range(len(reqs)))
    for i, (mode, res) in enumerate(zip(modes, results)):
        if mode == "none":
            assert res.ok and res.tokens == alone[i], i
        elif mode == "on_token":
            assert (res.finish_reason, res.error) == ("cancelled", ErrorCode.CANCELLED)
            assert res.tokens == alone[i][: at + 1] and "Boom" in res.message and f"token {at}" in res.message
        else:  # finished, then its on_result raised: cancelled by its callback, every token kept
            assert (res.finish_reason, res.error, res.tokens) == ("cancelled", ErrorCode.CANCELLED, alone[i])
            assert "on_result raised" in res.message and "Boom" in res.message
    assert not engine._slots and not engine.tbook.active.any()


def test_calls_from_several_threads_get_their_own_results(served):
    engine, alone = served
    out, errors = {}, []

    def caller(t: int):
        try:
            mine = [(t + j) % len(PROMPTS) for j in range(3)]
            got = []
            results = engine.generate([make(i) for i in mine], on_result=lambda i, r: got.append((i, r.tokens)))
            out[t] = (mine, results, got, threading.get_ident())
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    for mine, results, got, _ in out.values():
        assert [r.tokens for r in results] == [alone[i] for i in mine]
        assert sorted(got) == sorted((j, alone[i]) for j, i in enumerate(mine))  # its own callback, its own indices


def test_a_stream_in_one_thread_and_generate_in_another(served):
    """Thread A's stream consumer raises after two events: A's requests are cancelled; thread B's call, waiting
    meanwhile, gets exactly its tokens alone."""
    engine, alone = served
    started, b_out = threading.Event(), {}

    def b():
        started.wait()
        b_out["res"] = engine.generate([make(1), make(2)])

    th = threading.Thread(target=b)
    th.start()
    cancelled = engine.stats.cancelled
    stream = engine.stream([make(3), make(4)])
    with pytest.raises(Boom):
        for n, _ in enumerate(stream):
            started.set()
            if n == 1:
                raise Boom("consumer")
    stream.close()  # a consumer that raised holds the engine until its stream is closed (or collected)
    th.join()
    assert [r.tokens for r in b_out["res"]] == [alone[1], alone[2]]
    assert engine.stats.cancelled == cancelled + 2  # A's two requests


def test_a_call_from_inside_a_call_fails_at_once(served):
    engine, alone = served
    inner = []

    def reenter(ev):
        try:
            engine.generate([make(0)])
        except EngineBusy as exc:
            inner.append(str(exc))
            raise

    res = engine.generate([make(0, on_token=reenter), make(1)])
    assert inner and "inside another call of this engine" in inner[0]
    assert res[0].error is ErrorCode.CANCELLED and "EngineBusy" in res[0].message
    assert res[1].ok and res[1].tokens == alone[1]
    stream = engine.stream([make(0)])
    with pytest.raises(EngineBusy):
        for _ in stream:
            engine.park("draft")
    stream.close()
    assert engine.parked == () and engine.generate([make(2)])[0].tokens == alone[2]
