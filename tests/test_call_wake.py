"""A decode call ends as soon as a row finishes only when a request waits for a slot (`Rows.wake`): with nothing
waiting, rows that finish early idle to the call's end and the others go on, so a batch of unequal requests takes
fewer calls (on the H200 at 16 rows a speculative batch made 12 calls where rows finishing ended most of them).
Tokens are the same either way."""

from __future__ import annotations

import pytest
from small_engine import one_layer_model, small_engine

from ds4jax.generation.requests import Request


@pytest.fixture(scope="module")
def engine():
    return small_engine(one_layer_model())


def _requests(k):
    prompts = ([5, 9, 2, 7], [3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8], [6, 6, 6])
    return [Request(prompt=p, max_new_tokens=n, speculative=k) for p, n in zip(prompts, (2, 3, 4, 4))]


@pytest.mark.parametrize("k", [0, None], ids=["plain", "speculative"])
def test_finished_rows_do_not_end_the_call_when_nothing_waits(engine, k):
    # every request alone: the tokens each must give
    alone = [engine.generate([r])[0].tokens for r in _requests(k)]
    before = engine.stats.decode_calls + engine.stats.spec_calls
    together = engine.generate(_requests(k))  # 4 rows in 4 slots, nothing waiting: steps_per_call=4 covers all
    calls = engine.stats.decode_calls + engine.stats.spec_calls - before
    assert [r.tokens for r in together] == alone
    assert calls == 1, calls  # rows finishing after 1, 2 and 3 steps ended a call each before `wake`


def test_a_waiting_request_ends_the_call_when_a_row_finishes(engine):
    reqs = _requests(0) + [Request(prompt=[1, 2, 3], max_new_tokens=3)]  # a fifth request: 4 slots, it waits
    alone = [engine.generate([r])[0].tokens for r in reqs]
    steps0, calls0 = engine.stats.decode_steps, engine.stats.decode_calls
    got = engine.generate(reqs)
    assert [r.tokens for r in got] == alone
    # call 1 ends after its first step, which finishes request 0 (2 tokens: one from prefill); the fifth request
    # takes its slot, and call 2 (nothing waits now) runs the rest side by side: 1 + 2 steps. Had call 1 run on
    # while a request waited, it would take 3 steps and the fifth request 2 more, alone
    assert (engine.stats.decode_calls - calls0, engine.stats.decode_steps - steps0) == (2, 3)


@pytest.mark.parametrize("waiting", [None, False, True], ids=["feed", "feed-nothing-waits", "feed-one-waits"])
def test_a_feed_ends_calls_on_finished_rows_only_while_a_request_waits_at_it(engine, waiting):
    """A server feeds its engine (`stream(feed=...)`) and says whether requests wait for a slot (`waiting`, the
    driver's queue): with nothing waiting, the rows that finish early idle to the call's end as in `generate`;
    with a request waiting, or no `waiting` to ask (any feed may bring one), each finishing row ends its call."""
    alone = [engine.generate([r])[0].tokens for r in _requests(0)]
    before = engine.stats.decode_calls
    asked = []

    def waits() -> bool:
        asked.append(waiting)
        return waiting

    kw = {} if waiting is None else {"waiting": waits}
    events = list(engine.stream(_requests(0), feed=list, **kw))
    calls = engine.stats.decode_calls - before
    assert [r.tokens for r in engine.last_results] == alone and len(events) == sum(map(len, alone))
    # rows finish after 1, 2 and 3 decode steps (requests of 2, 3 and 4 tokens; the 4th also needs 3)
    assert calls == (1 if waiting is False else 3), calls
    assert bool(asked) == (waiting is not None)


def test_the_draft_policy_is_told_when_the_rows_drain(engine, monkeypatch):
    """The policy weighs a draining batch by its slowest row (`draft_policy`): `drain` is True exactly when no
    request waits for a slot (the same condition as `Rows.wake`, negated)."""
    seen = []
    choose = engine.policy.choose

    def spy(live, rows, drain=False):
        seen.append(drain)
        return choose(live, rows, drain=drain)

    monkeypatch.setattr(engine.policy, "choose", spy)
    engine.generate(_requests(None))  # 4 requests, 4 slots: nothing waits
    assert seen and all(seen), seen
    seen.clear()
    engine.generate(_requests(None) + [Request(prompt=[1, 2, 3], max_new_tokens=3, speculative=None)])
    assert seen[0] is False and seen[-1] is True, seen  # the fifth waits at first, then the rows drain
