"""`Request.on_tokens`: one callback per delivery (a call's tokens of one request) instead of `on_token` per token,
with the same events, results and counters (stop ids and strings, max_new_tokens, a forced thinking close,
logprobs, non-finite rows), the stopping token of a stop string included; returning False or raising cancels the
request after those tokens. `Engine.iterations` (the server's driver loop) yields once per engine iteration, when
every token it delivered is with the callbacks, and gives what `generate` gives."""

from __future__ import annotations

import numpy as np
import pytest
from small_engine import one_layer_model, small_engine

from ds4jax.generation import logprob_rows
from ds4jax.generation.delivery import Delivery, EngineStats, Live
from ds4jax.generation.requests import Budget, GenerateResult, Request
from ds4jax.generation.sampling import TokenLogprobs, seed_key_data
from ds4jax.io.tokenizer import ByteTokenizer

H = ord("h") + 3  # ByteTokenizer ids: byte + 3


class Seen:
    """A callback for either field that records what it got: calls (lists of events) and events; `keep` is what
    it returns (or an exception it raises)."""

    def __init__(self, keep=True):
        self.calls, self.keep = [], keep

    def __call__(self, got):
        self.calls.append(got if isinstance(got, list) else [got])
        if isinstance(self.keep, Exception):
            raise self.keep
        return self.keep

    @property
    def events(self):
        return [e for call in self.calls for e in call]


def rows(field: str, keep=True):
    """Live requests with tricky properties, each watched by a `Seen` through `field`, and a call's outputs."""
    kinds = [dict(max_new_tokens=50), dict(max_new_tokens=3), dict(max_new_tokens=50, stop_ids=(H,)),
             dict(max_new_tokens=50, logprobs=2), dict(max_new_tokens=50, stop_strings=("hi",)),
             dict(max_new_tokens=50, budget=Budget(max_tokens=2, close_ids=(9, 10))), dict(max_new_tokens=50)]
    lvs = []
    for i, kw in enumerate(kinds):
        q = Request([5], **kw, **{field: Seen(keep)})
        lv = Live(i, q, [5], GenerateResult(logprobs=None if q.logprobs is None else []), 0, seed_key_data(0),
                  np.full(8, -1, np.int32), 0.0, in_span=q.budget is not None)
        lv.slot, lv.pos = i, 1
        lvs.append(lv)
    tokens = np.random.default_rng(0).integers(3, 40, (len(kinds), 5)).astype(np.int32)
    tokens[2, 2], tokens[2, 3:] = H, -1  # a stop id, then nothing (as the device does)
    tokens[4, 1:3] = [H, ord("i") + 3]  # "hi" completes at the row's 3rd token of this call
    bad = np.full(len(kinds), -1, np.int32)
    bad[6] = 3  # non-finite from its 4th token
    rng = np.random.default_rng(1)
    lp = TokenLogprobs(-rng.random(tokens.shape).astype(np.float32),
                       rng.integers(0, 40, tokens.shape + (2,)).astype(np.int32),
                       -rng.random(tokens.shape + (2,)).astype(np.float32))
    return lvs, tokens, bad, lp


def run(field: str, keep=True):
    lvs, tokens, bad, lp = rows(field, keep)
    out = Delivery(EngineStats(), ByteTokenizer())
    for lv in lvs:  # first tokens, as prefill delivers them: alone
        out.deliver(lv, [20 + lv.index], None, logprob_rows.row(lp, 0, 1, lv.request.logprobs))
    out.deliver_call(lvs, {lv.slot: i for i, lv in enumerate(lvs)}, tokens, bad, lp, None, True)
    keys = ("tokens", "text", "finish_reason", "error", "nonfinite_at", "logprobs", "budget_forced_close")
    results = [{k: getattr(lv.result, k) for k in keys} for lv in lvs]
    return lvs, results, vars(out.stats)


def test_on_tokens_gets_the_events_on_token_gets_one_call_per_delivery():
    per_token, bulk = run("on_token"), run("on_tokens")
    assert per_token[1] == bulk[1] and per_token[2] == bulk[2]
    for a, b in zip(per_token[0], bulk[0]):
        assert a.request.on_token.events == b.request.on_tokens.events
        assert len(b.request.on_tokens.calls) == 2  # the first token, then the call's tokens
    results = bulk[1]
    assert [lv.done for lv in bulk[0]] == [False, True, True, False, True, False, True]  # 0, 3, 5 run on
    assert [results[i]["finish_reason"] for i in (1, 2, 4, 6)] == ["length", "stop", "stop", "error"]
    assert results[2]["tokens"][-1] == H
    assert results[4]["tokens"][-2:] == [H, ord("i") + 3]  # the stopping token was delivered (and seen)
    assert results[4]["text"] == ByteTokenizer().decode(results[4]["tokens"][:-2])
    assert results[5]["budget_forced_close"]


@pytest.mark.parametrize("keep", [False, RuntimeError("boom")], ids=["returns-false", "raises"])
def test_on_tokens_cancels_after_the_tokens_it_was_given(keep):
    lvs, results, stats = run("on_tokens", keep)
    word = "returned False" if keep is False else "raised"
    for lv, r in zip(lvs, results):  # every request cancels at its first token, which stays in its result
        assert r["finish_reason"] == "cancelled" and r["tokens"] == [20 + lv.index]
        assert f"on_tokens {word}" in lv.result.message and len(lv.request.on_tokens.calls) == 1
    assert stats["cancelled"] == len(lvs)


def test_a_request_with_both_callbacks_is_refused():
    engine = small_engine(one_layer_model())
    res = engine.generate([Request([5, 6], max_new_tokens=2, on_token=Seen(), on_tokens=Seen())])[0]
    assert not res.ok and "on_tokens" in res.message


def test_iterations_yield_once_per_iteration_with_every_token_delivered():
    engine = small_engine(one_layer_model())
    prompts = ([5, 9, 2, 7], [3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8], [6, 6, 6], [1, 2])
    alone = [r.tokens for r in engine.generate([Request(p, max_new_tokens=6) for p in prompts])]
    seen = [Seen() for _ in prompts]
    reqs = [Request(p, max_new_tokens=6, on_tokens=s) for p, s in zip(prompts, seen)]
    fed, feeds = [reqs[3:]], []  # more requests than slots, some fed into the running loop

    def feed():  # called before every iteration, and once more when nothing is left
        feeds.append(1)
        return fed.pop() if fed else []

    before, ticks = engine.stats.tokens, 0
    for item in engine.iterations(reqs[:3], feed=feed):
        assert item is None and sum(len(s.events) for s in seen) == engine.stats.tokens - before
        ticks += 1
    assert [r.tokens for r in engine.last_results] == alone == [[e.token for e in s.events] for s in seen]
    assert [[e.index for e in s.events] for s in seen] == [list(range(6))] * len(prompts)
    assert ticks == len(feeds) - 1 and ticks > 1 and not engine._slots
