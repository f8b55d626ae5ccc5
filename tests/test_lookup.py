"""Lookup drafting (`ds4jax/generation/lookup.py`): the device's match and proposal against a plain-Python rule on
random histories, the history kept by `append` and `host_history`, and the Engine with `lookup` on: greedy
tokens equal plain decoding's (with run-ahead, and against run-ahead off), rounds did draft by lookup and skipped
the MTP chain (the dispatch itself), a sampling row never drafts by lookup and keeps the chain running, nothing
compiles after warm-up, and bad settings are refused by name."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from small_engine import MAX_CONTEXT, one_layer_model

from ds4jax import Engine, Request
from ds4jax.generation import decode_calls, lookup, run_ahead
from ds4jax.generation.loops import Rows
from ds4jax.io.tokenizer import ByteTokenizer
from ds4jax.runtime.pools import PoolError


@settings(max_examples=80, deadline=None)
@given(seq=st.lists(st.integers(0, 3), min_size=0, max_size=30), window=st.sampled_from([1, 2, 5, 12, 32]),
       k=st.integers(1, 5), min_n=st.integers(1, lookup.MAX_N))
def test_proposals_follow_the_reference_rule(seq, window, k, min_n):
    history = lookup.host_history([seq], window)
    drafts, found = lookup.propose(jnp.asarray(history), k, min_n)
    want = lookup.reference_propose(seq[-window:], k, min_n) if seq else None
    assert bool(found[0]) == (want is not None)
    if want is not None:
        assert drafts[0].tolist() == want


def test_longest_then_latest_match_and_a_periodic_continuation():
    # the suffix "5 1 2" occurred first: its 3-token match (-> 8) beats the later 2-token "1 2" (-> 9)
    seq = [5, 1, 2, 8, 1, 2, 9, 5, 1, 2]
    assert lookup.reference_propose(seq, 2, 1) == [8, 1]
    drafts, found = lookup.propose(jnp.asarray(lookup.host_history([seq], 16)), 2, 1)
    assert bool(found[0]) and drafts[0].tolist() == [8, 1]
    # equally long matches: the latest wins ("1 2" -> 9 over -> 8 when "5" does not extend either)
    seq = [1, 2, 8, 1, 2, 9, 4, 1, 2]
    drafts, _ = lookup.propose(jnp.asarray(lookup.host_history([seq], 16)), 1, 1)
    assert drafts[0].tolist() == [9]
    # "3 4 3 4": the continuation runs past the end and repeats the proposal
    drafts, _ = lookup.propose(jnp.asarray(lookup.host_history([[3, 4, 3, 4]], 8)), 5, 2)
    assert drafts[0].tolist() == [3, 4, 3, 4, 3]


def test_padding_and_short_histories_never_match():
    history = lookup.host_history([None, [7], [7, 7]], 6)
    assert history[0].tolist() == [-1] * 6 and history[1].tolist() == [-1] * 5 + [7]
    drafts, found = lookup.propose(jnp.asarray(history), 3, 1)
    assert found.tolist() == [False, False, True]  # -1 padding equals itself but never counts
    assert drafts[2].tolist() == [7, 7, 7] and drafts[0].tolist() == [0, 0, 0]
    assert not bool(lookup.propose(jnp.asarray(history), 3, 2)[1][2])  # "7 7" needs a 2-token match before it


def test_append_keeps_the_newest_tokens():
    history = jnp.asarray(lookup.host_history([[1, 2, 3], [4], None], 5))
    got = lookup.append(history, jnp.asarray([[7, 8, 9], [5, 6, 0], [1, 1, 1]]), jnp.asarray([2, 3, 0]))
    assert got.tolist() == [[1, 2, 3, 7, 8], [-1, 4, 5, 6, 0], [-1] * 5]
    assert lookup.host_history([list(range(10))], 4).tolist() == [[6, 7, 8, 9]]


@pytest.mark.parametrize("bad", [-1, lookup.MAX_N + 1, 1.5, True, "3"])
def test_bad_lookup_values_are_named(bad):
    with pytest.raises(ValueError, match="lookup must be an int"):
        lookup.check_min_n(bad)


def test_run_ahead_carries_the_history_a_call_ended_with():
    rows = Rows(*([np.zeros(1)] * 15), history=np.zeros((1, 4)))
    out = type("Out", (), dict(cur=1, n_out=2, live=True, history="after"))()
    assert run_ahead.next_rows(rows, out).history == "after"
    plain = type("Out", (), dict(cur=1, n_out=2, live=True))()
    assert run_ahead.next_rows(rows, plain).history is rows.history


@pytest.fixture(scope="module")
def model():
    return one_layer_model()


def engine(model, lookup_n: int) -> Engine:
    return Engine(model, max_slots=4, max_context=MAX_CONTEXT, speculative=3, prefill_chunk=8, row_buckets=(4,),
                  steps_per_call=4, tokenizer=ByteTokenizer(), snapshot_bytes=0, lookup=lookup_n)


REPEATING = [5, 6, 7, 8] * 5  # a prompt whose history always holds a match


def greedy(prompt, n=24):
    return Request(prompt=list(prompt), max_new_tokens=n)


def test_lookup_engine_gives_plain_greedy_tokens_and_skips_the_chain(model, monkeypatch):
    plain = Engine(model, max_slots=4, max_context=MAX_CONTEXT, prefill_chunk=8, row_buckets=(4,), steps_per_call=4)
    prompts = [REPEATING, [9, 3, 9, 3, 9], [1, 2, 3, 4, 5, 6]]
    want = [r.tokens for r in plain.generate([greedy(p) for p in prompts])]
    e = engine(model, 1)
    report = e.warmup()
    assert report.programs
    for p, w in zip(prompts, want):  # one at a time (padded rows are done): a round can skip the chain
        assert e.generate([greedy(p)])[0].tokens == w
    assert e.stats.lookup_drafts > 0 and e.stats.lookup_skips > 0
    assert e.stats.compiles_after_warmup == 0
    counted = lambda: (e.stats.spec_rounds, e.stats.lookup_drafts, e.stats.lookup_skips)  # noqa: E731
    before = counted()
    made = []

    class Counting(run_ahead.Ahead):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self.k)

    with monkeypatch.context() as m:
        m.setattr(run_ahead, "Ahead", Counting)
        together = [r.tokens for r in e.generate([greedy(p) for p in prompts])]  # batch 4, rows mixed
    assert together == want and 3 in made  # speculative calls did run ahead
    ahead = [b - a for a, b in zip(before, counted())]
    with monkeypatch.context() as m:  # and without run-ahead (the host builds every call's history)
        m.setattr(run_ahead, "may_run_ahead", lambda plan: False)
        before = counted()
        assert [r.tokens for r in e.generate([greedy(p) for p in prompts])] == want
    # the histories a call run ahead took from its predecessor on the device are the ones the host builds: the
    # same rounds, the same lookups
    assert [b - a for a, b in zip(before, counted())] == ahead and ahead[1] > 0
    assert e.stats.compiles_after_warmup == 0


def test_a_sampling_row_never_drafts_by_lookup(model, monkeypatch):
    e = engine(model, 1)
    calls = []  # per speculative call: (rows' temperatures, looked per row, skipped rounds)
    read = decode_calls.EngineDecode._read

    def spy(self, plan, part, out, k, *args, **kwargs):
        got = read(self, plan, part, out, k, *args, **kwargs)
        if k:  # (after delivery: whether a row ended in this call, after which the others may skip)
            looked = np.asarray(out.looked)
            live = [(r, lv) for r, lv in enumerate(plan) if lv is not None]
            calls.append(([(lv.request.temperature, lv.done) for _, lv in live], [int(looked[r]) for r, _ in live],
                          int(out.skipped)))
        return got

    monkeypatch.setattr(decode_calls.EngineDecode, "_read", spy)
    e.generate([Request(prompt=REPEATING, max_new_tokens=24, temperature=0.9, seed=5), greedy(REPEATING)])
    assert calls and e.stats.lookup_drafts > 0
    for rows, looked, skipped in calls:
        assert all(n == 0 for (t, _), n in zip(rows, looked) if t > 0)  # the sampler: MTP drafts only
        if any(t > 0 and not done for t, done in rows):
            assert skipped == 0  # the chain ran in every round of a call the sampler ran through


def test_on_by_default_with_speculation_only(model):
    assert Engine(model, max_slots=4, max_context=MAX_CONTEXT, speculative=2).lookup == lookup.DEFAULT_MIN_N
    assert Engine(model, max_slots=4, max_context=MAX_CONTEXT, speculative=2, lookup=0).lookup == 0
    assert Engine(model, max_slots=4, max_context=MAX_CONTEXT).lookup == 0


def test_bad_engine_settings_are_refused(model):
    with pytest.raises(PoolError, match="speculative=k"):
        Engine(model, max_slots=4, max_context=MAX_CONTEXT, lookup=2)
    with pytest.raises(PoolError, match="lookup must be an int"):
        Engine(model, max_slots=4, max_context=MAX_CONTEXT, speculative=2, lookup=lookup.MAX_N + 1)


def test_without_free_branches_the_chain_runs_and_tokens_stay_plain(model, monkeypatch):
    """Where a `lax.cond` costs a host round trip (ROCm: `sampling.branch_on_greedy` off) the chain runs in every
    round: the looked-up drafts still replace its proposals, and no round counts as skipped."""
    monkeypatch.setenv("DS4JAX_GREEDY_BRANCH", "off")
    plain = Engine(model, max_slots=4, max_context=MAX_CONTEXT, prefill_chunk=8, row_buckets=(4,), steps_per_call=4)
    want = plain.generate([greedy(REPEATING)])[0].tokens
    # 3 rounds a call: a program traced now (the setting is read at trace time; jit caches by static arguments)
    e = Engine(model, max_slots=4, max_context=MAX_CONTEXT, speculative=3, prefill_chunk=8, row_buckets=(4,),
               steps_per_call=3, snapshot_bytes=0, lookup=1)
    assert e.generate([greedy(REPEATING)])[0].tokens == want
    assert e.stats.lookup_drafts > 0 and e.stats.lookup_skips == 0
