"""`Engine.stats` counts what happened, exactly: prefill steps, decode calls and steps, speculative calls and
rounds, tokens delivered, prompt tokens prefilled, completed / failed / cancelled requests and compilations; a
result's timings add up, and a result the engine never completed counts as failed."""

from __future__ import annotations

import dataclasses

import pytest

from ds4jax import ErrorCode, GenerateResult, Request
from small_engine import one_layer_model, small_engine

CHUNK, M = 8, 4  # small_engine's prefill width and steps per call


@pytest.fixture(scope="module")
def engine():
    eng = small_engine(one_layer_model())
    warm = eng.warmup().compiles
    # (0 when another test of this process compiled the same programs already)
    assert eng.stats.compiles == warm and eng.stats.compiles_after_warmup == 0
    return eng


def delta(engine, requests):
    before = dataclasses.asdict(engine.stats)
    results = engine.generate(requests)
    after = dataclasses.asdict(engine.stats)
    return results, {k: after[k] - before[k] for k in after}


def test_plain_request_alone(engine):
    """10 prompt tokens in chunks of 8: two prefill steps; 8 tokens after the first at M=4 per call: two calls."""
    (r,), d = delta(engine, [Request(prompt=list(range(3, 13)), max_new_tokens=9, speculative=0)])
    assert r.ok and len(r.tokens) == 9
    t = r.timings
    assert t.queue_s >= 0 and t.prefill_s > 0 and t.decode_s > 0
    assert t.tokens_per_s == pytest.approx(9 / (t.prefill_s + t.decode_s))
    assert d == dict(d, prefill_steps=2, prompt_tokens=10, decode_calls=2, decode_steps=8, spec_calls=0,
                     spec_rounds=0, tokens=9, completed=1, failed=0, cancelled=0, compiles=0,
                     compiles_after_warmup=0)


def test_speculative_request_alone(engine):
    """Every speculative round of a request alone is counted once, and its accepted drafts are its result's."""
    (r,), d = delta(engine, [Request(prompt=list(range(20, 25)), max_new_tokens=7)])
    assert r.ok and len(r.tokens) == 7
    assert d["spec_rounds"] == len(r.accepted_per_round) >= d["spec_calls"] >= 1
    assert sum(a + 1 for a in r.accepted_per_round) >= 6  # each round delivers accepted drafts + 1 tokens
    assert d == dict(d, prefill_steps=1, prompt_tokens=5, decode_calls=0, decode_steps=0, tokens=7, completed=1,
                     failed=0, cancelled=0, compiles=0, compiles_after_warmup=0)


def test_outcomes_of_a_mixed_batch(engine):
    results, d = delta(engine, [
        Request(prompt=list(range(3, 9)), max_new_tokens=5, speculative=0),
        Request(prompt=[], max_new_tokens=5),  # invalid: never prefilled
        Request(prompt=list(range(40, 43)), max_new_tokens=6, on_token=lambda ev: ev.index < 1),  # 2 tokens
        Request(prompt=[7] * 200, max_new_tokens=5),  # prompt_too_long: never prefilled
        Request(prompt=list(range(50, 54)), max_new_tokens=3)])
    assert [r.error for r in results] == [None, ErrorCode.INVALID_REQUEST, ErrorCode.CANCELLED,
                                          ErrorCode.PROMPT_TOO_LONG, None]
    assert [len(r.tokens) for r in results] == [5, 0, 2, 0, 3]
    assert d == dict(d, tokens=10, prompt_tokens=6 + 3 + 4, completed=2, failed=2, cancelled=1,
                     compiles=0, compiles_after_warmup=0)
    assert d["prefill_steps"] == 1  # three prompts of at most 8 tokens on free slots: one chunk together


def test_a_result_is_failed_until_the_engine_completes_it():
    r = GenerateResult()
    assert (r.ok, r.error, r.finish_reason, r.message) == (False, ErrorCode.INTERNAL, "error", "not completed")
