"""`Delivery.deliver_call` (one numpy split of a call's tokens, rows delivered in bulk unless a callback, stop string
or thinking budget must see each token) gives exactly what the former per-token path gave (`OldDelivery` and
`old_call` below, the code as it was): results, events, callback calls and counters, on tricky rows: stop ids,
max_new_tokens, non-finite rows with the check on and off, logprobs asked by some rows only, a callback that
cancels mid-call, stop strings, a budget that forces its close, gaps (-1) and finished rows. Host only."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from ds4jax.generation import logprob_rows
from ds4jax.generation.delivery import Delivery, EngineStats, Live, track_budget
from ds4jax.generation.requests import Budget, ErrorCode, FinishReason, GenerateResult, Request, TokenEvent
from ds4jax.generation.sampling import TokenLogprobs, seed_key_data
from ds4jax.io.tokenizer import ByteTokenizer

B, W, N = 10, 6, 3  # rows, tokens per row, logprob alternatives


class OldDelivery(Delivery):
    def deliver(self, lv, tokens, events, logprobs=None):
        del lv.forced[: len(tokens)]
        for j, t in enumerate(tokens):
            if lv.done:
                return
            track_budget(lv, t)
            res = lv.result
            lp = logprobs[j] if logprobs is not None else None
            ev = TokenEvent(lv.index, t, len(res.tokens), lp)
            res.tokens.append(t)
            if lp is not None:
                res.logprobs.append(lp)
            lv.cur = t
            self.stats.tokens += 1
            events.append(ev)
            if lv.request.on_token is not None:
                try:
                    keep = lv.request.on_token(ev)
                except Exception as exc:  # noqa: BLE001
                    self.finish(lv, FinishReason.CANCELLED, ErrorCode.CANCELLED, f"on_token raised {exc!r}")
                    return
                if keep is False:
                    self.finish(lv, FinishReason.CANCELLED, ErrorCode.CANCELLED, "on_token returned False")
                    return
            if lv.request.stop_strings:
                text = self.tokenizer.decode(res.tokens)
                hit = [text.index(s) for s in lv.request.stop_strings if s and s in text]
                if hit:
                    self.finish(lv, FinishReason.STOP)
                    lv.result.text = text[: min(hit)]
                    return


def old_call(out, part, row_of, tokens, bad, lp, events, check):
    """The former per-row loop of `Engine._decode_once` (books and rounds aside)."""
    for lv in part:
        r = row_of[lv.slot]
        if bad[r] >= 0 and lv.result.nonfinite_at is None:
            lv.result.nonfinite_at = int(bad[r])
        emitted = [int(t) for t in tokens[r] if t >= 0]
        if check and bad[r] >= 0:
            emitted = emitted[: max(int(bad[r]) - len(lv.result.tokens), 0)]
        out.deliver(lv, emitted, events, logprob_rows.row(lp, r, len(emitted), lv.request.logprobs))
        if check and bad[r] >= 0 and not lv.done:
            out.fail_nonfinite(lv)
        if not lv.done:
            out.check_finished(lv)


def on_token_until(n: int):
    """A callback that records its events and cancels (returns False) at the request's token `n`."""
    seen = []

    def cb(ev):
        seen.append(ev)
        return ev.index != n

    cb.seen = seen
    return cb


def raising(ev):
    if ev.index == 3:
        raise RuntimeError("boom")


def make_rows(seed: int):
    """B rows of requests, each with one tricky property, and a call's outputs for them."""
    h = ord("h") + 3  # ByteTokenizer ids: byte + 3
    reqs = [Request([5], max_new_tokens=50),  # plain, bulk
            Request([5], max_new_tokens=4),  # reaches max_new_tokens inside the call
            Request([5], max_new_tokens=50, stop_ids=(h,)),  # ends on a stop id
            Request([5], max_new_tokens=50, logprobs=2),  # asks for logprobs
            Request([5], max_new_tokens=50, logprobs=0, on_token=on_token_until(4)),  # cancels mid-call
            Request([5], max_new_tokens=50, stop_strings=("hi",)),  # a stop string
            Request([5], max_new_tokens=50, budget=Budget(max_tokens=3, close_ids=(9, 10))),  # forces its close
            Request([5], max_new_tokens=50, on_token=raising),  # a callback that raises
            Request([5], max_new_tokens=50),  # non-finite from its 4th token
            Request([5], max_new_tokens=50, logprobs=1)]  # non-finite at once, with logprobs
    lvs = []
    for i, q in enumerate(reqs):
        lv = Live(i, q, [5], GenerateResult(logprobs=None if q.logprobs is None else []), 0, seed_key_data(0),
                  np.full(8, -1, np.int32), 0.0, in_span=q.budget is not None)
        lv.slot, lv.pos = (i * 7) % 16, 1
        lv.result.tokens = [20 + i]  # a first token already delivered
        if q.logprobs is not None:
            lv.result.logprobs = logprob_rows.row(fake_lp(1, 1), 0, 1, q.logprobs)
        lvs.append(lv)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, 40, (B, W)).astype(np.int32)
    tokens[2, 3] = h  # the stop id, then (as the device does) nothing
    tokens[2, 4:] = -1
    tokens[5, 1:3] = [h, ord("i") + 3]
    tokens[0, 4:] = -1  # the row finished early
    bad = np.full(B, -1, np.int32)
    bad[8], bad[9] = 4, 1  # token index 4 is the first bad one (one token delivered before this call)
    return lvs, tokens, bad, fake_lp(B, W)


def fake_lp(b, w) -> TokenLogprobs:
    rng = np.random.default_rng(b * 100 + w)
    return TokenLogprobs(-rng.random((b, w)).astype(np.float32), rng.integers(0, 40, (b, w, N)).astype(np.int32),
                         -rng.random((b, w, N)).astype(np.float32))


def outcome(lvs, events, stats):
    keep = ("tokens", "text", "finish_reason", "error", "message", "nonfinite_at", "logprobs", "budget_forced_close")
    res = [{k: getattr(lv.result, k) for k in keep} for lv in lvs]
    seen = [list(lv.request.on_token.seen) for lv in lvs if hasattr(lv.request.on_token, "seen")]
    return res, [(lv.done, lv.cur, lv.forced, lv.in_span, lv.span_count) for lv in lvs], events, seen, vars(stats)


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("with_lp", [True, False])
def test_bulk_delivery_equals_per_token_delivery(check, seed, with_lp):
    got = []
    for cls, call in ((OldDelivery, old_call), (Delivery, None)):
        lvs, tokens, bad, lp = make_rows(seed)
        lvs = copy.deepcopy(lvs)  # fresh callbacks' records per run
        for lv in lvs:
            if hasattr(lv.request.on_token, "seen"):
                lv.request.on_token.seen.clear()
        out, events = cls(EngineStats(), ByteTokenizer()), []
        part = lvs[::-1]  # delivery follows `part`, not the rows
        row_of = {lv.slot: i for i, lv in enumerate(lvs)}
        (call or (lambda o, *a: o.deliver_call(*a)))(out, part, row_of, tokens, bad, lp if with_lp else None,
                                                     events, check)
        got.append(outcome(lvs, events, out.stats))
    assert got[0] == got[1]
    results = got[1][0]
    assert results[1]["finish_reason"] == "length" and results[2]["finish_reason"] == "stop"
    assert results[4]["finish_reason"] == "cancelled" and results[7]["finish_reason"] == "cancelled"
    assert results[6]["budget_forced_close"]
    assert results[5]["finish_reason"] == "stop" and (results[8]["error"] == ErrorCode.NON_FINITE) == check


def test_generate_builds_no_events_and_the_stream_the_same_ones():
    """events=None (Engine.generate): the same results, no TokenEvent list; callbacks still get theirs."""
    runs = []
    for events in ([], None):
        lvs, tokens, bad, lp = make_rows(0)
        lvs = copy.deepcopy(lvs)
        for lv in lvs:
            if hasattr(lv.request.on_token, "seen"):
                lv.request.on_token.seen.clear()
        out = Delivery(EngineStats(), ByteTokenizer())
        out.deliver_call(lvs, {lv.slot: i for i, lv in enumerate(lvs)}, tokens, bad, lp, events, True)
        runs.append(outcome(lvs, events, out.stats))
    assert runs[0][2] and runs[1][2] is None
    assert [r for i, r in enumerate(runs[0]) if i != 2] == [r for i, r in enumerate(runs[1]) if i != 2]
