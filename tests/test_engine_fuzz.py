"""Fuzzed `ds4jax.Request`s through a live `Engine` (hypothesis, CI-sized, deterministic).

Property: whatever a request holds (wrong types, huge / negative / NaN values, bad token ids, empty or too-long
prompts, odd stop ids, budgets, callbacks), `Engine.generate` returns a `GenerateResult` for it and never raises;
a result is either complete (ids inside the vocabulary, finite logits) or carries an `ErrorCode` other than
INTERNAL (an internal error would be an engine bug), and the good requests of the same batch get exactly the
tokens they get alone. One warmed-up engine serves every example, so each costs milliseconds.
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from ds4jax import Budget, ErrorCode, FinishReason, GenerateResult, Request
from small_engine import MAX_CONTEXT, one_layer_model, small_engine

CI = settings(derandomize=True, database=None, deadline=None, print_blob=False, max_examples=60,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                     HealthCheck.data_too_large])
VOCAB = 256  # tiny()'s; the byte tokenizer's ids reach 258, so some text prompts leave the vocabulary

# The good requests every batch carries: greedy speculative, and seeded sampling on the plain path.
GOOD = (Request(prompt=[5, 17, 200, 3, 9, 41, 77, 12, 250, 6, 8], max_new_tokens=9),
        Request(prompt=[30, 31, 32], max_new_tokens=7, temperature=0.9, top_p=0.8, top_k=20, seed=7, speculative=0))


@pytest.fixture(scope="module")
def served():
    """(engine, tokens of each GOOD request run alone)."""
    engine = small_engine(one_layer_model())
    engine.warmup()
    alone = [engine.generate([g])[0] for g in GOOD]
    assert all(r.ok for r in alone), [r.message for r in alone]
    return engine, [r.tokens for r in alone]


# ---- strategies ------------------------------------------------------------------------------------------------

odd_int = st.one_of(st.integers(-3, VOCAB + 3), st.sampled_from([2**31, 2**32 + 1, 2**63, 2**64, -(2**63) - 1, 10**30]),
                    st.builds(np.int64, st.integers(-2, 300)),
                    st.builds(np.uint64, st.sampled_from([0, 2**63, 2**64 - 1])),
                    st.builds(np.int32, st.integers(0, 10)))
odd_float = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                      st.sampled_from([0.0, -0.0, 5e-324, 1e-45, 1e-300, 1e-38, 3.4e38, 1e39, 1.0, 1.5]),
                      st.builds(np.float32, st.sampled_from([math.nan, 0.5, 1e-45, 2.0])))
junk = st.one_of(st.none(), st.booleans(), st.text(max_size=3), st.binary(max_size=3), st.just(object()),
                 st.just(np.zeros((2, 2), np.int32)), st.just({"a": 1}), st.just(np.float64(3.0)))
ids = st.lists(odd_int, max_size=5)
prompt = st.one_of(
    st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=MAX_CONTEXT + 4),  # empty .. too long
    ids, st.text(max_size=12), st.sampled_from(["", "\x00\xff\U0001f600", "a" * 70]),
    st.builds(np.asarray, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)),
    st.builds(lambda x: np.asarray(x, np.float32), st.lists(st.integers(0, 9), min_size=1, max_size=3)), junk)


def _raises(_event):
    raise RuntimeError("callback failed")


budget = st.one_of(st.builds(Budget, st.one_of(odd_int, junk), st.one_of(ids, junk), st.one_of(ids, junk)),
                   st.builds(Budget, st.integers(1, 4), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3)))
# Values a request may legally hold, chosen at the edges (they reach the device programs), then anything at all.
EDGES = {
    "prompt": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=MAX_CONTEXT - 8),
    "max_new_tokens": st.sampled_from([1, 2, 30, 50, 2**31, 2**63]),
    "temperature": st.sampled_from([0.0, 5e-324, 1e-45, 1e-38, 1e-20, 0.7, 1e30, 3.4e38, 1e39, 1e308]),
    "top_k": st.sampled_from([0, 1, VOCAB - 1, VOCAB, 2**31, 2**63, 10**30]),
    "top_p": st.sampled_from([5e-324, 1e-300, 1e-45, 1e-8, 0.5, 1.0, np.float32(1e-45)]),
    "seed": st.sampled_from([0, -1, -(2**63), 2**63 - 1, 2**63, 2**64 - 1, np.uint64(2**64 - 1)]),
    "stop_ids": st.lists(st.integers(0, VOCAB - 1), max_size=9).map(tuple),
    "stop_strings": st.lists(st.text(min_size=1, max_size=2), max_size=2).map(tuple),
    "speculative": st.sampled_from([None, 0, 1, np.int64(1)]),
    "on_token": st.sampled_from([None, _raises, lambda e: False, lambda e: e.index < 2 or None]),
    "budget": st.builds(Budget, st.integers(1, 3), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=2),
                        st.lists(st.integers(0, VOCAB - 1), max_size=2)),
    "snapshot": st.booleans(),
    "snapshot_at": st.lists(st.integers(1, 3), max_size=2).map(tuple),
}
ANYTHING = {
    "prompt": prompt,
    "max_new_tokens": st.one_of(odd_int, odd_float, junk),
    "temperature": st.one_of(odd_float, odd_int, junk),
    "top_k": st.one_of(odd_int, junk),
    "top_p": st.one_of(odd_float, odd_int, junk),
    "seed": st.one_of(odd_int, odd_float, junk),
    "stop_ids": st.one_of(ids, junk),
    "stop_strings": st.one_of(st.lists(st.text(max_size=2), max_size=2).map(tuple), junk),
    "speculative": st.one_of(odd_int, junk),
    "on_token": st.sampled_from([3, "f"]),
    "budget": st.one_of(budget, junk),
    "snapshot": junk,
    "snapshot_at": st.one_of(ids, junk),
}


def field(name):
    return st.integers(0, 2).flatmap(lambda i: ANYTHING[name] if i == 0 else EDGES[name])  # edges 2 in 3


@st.composite
def fuzzed_request(draw):
    if draw(st.integers(0, 9)) == 0:  # not a Request at all
        return draw(st.one_of(junk, st.builds(dict, prompt=st.just([1, 2]))))
    fields = draw(st.lists(st.sampled_from(sorted(EDGES)), min_size=1, max_size=3, unique=True))
    base = dict(prompt=[4, 5, 6], max_new_tokens=3)
    return Request(**{**base, **{f: draw(field(f)) for f in fields}})


# ---- the property ----------------------------------------------------------------------------------------------

def check_result(result, request) -> None:
    assert isinstance(result, GenerateResult)
    if result.error is not None:
        assert isinstance(result.error, ErrorCode) and result.error is not ErrorCode.INTERNAL, result.message
        assert isinstance(result.message, str) and result.message
        return
    assert result.finish_reason in (FinishReason.STOP.value, FinishReason.LENGTH.value)
    assert result.nonfinite_at is None, "NaN/Inf logits"
    assert 1 <= len(result.tokens) <= int(request.max_new_tokens)
    assert all(isinstance(t, int) and 0 <= t < VOCAB for t in result.tokens)


@CI
@given(bad=st.lists(fuzzed_request(), min_size=1, max_size=3), where=st.integers(0, 3))
def test_fuzzed_requests_through_a_live_engine(served, bad, where):
    engine, alone = served
    batch = list(bad)
    batch.insert(min(where, len(batch)), GOOD[0])
    batch.append(GOOD[1])
    results = engine.generate(batch)
    assert len(results) == len(batch)
    for req, res in zip(batch, results):
        if req is GOOD[0] or req is GOOD[1]:
            assert res.ok and res.tokens == alone[GOOD.index(req)], res.message
        else:
            check_result(res, req)
    assert not engine._slots, "every slot is released after the batch"


# ---- what the fuzzing found: legal values beyond the device's types ----------------------------------------------

SAMPLED = dict(prompt=[9, 8, 7, 6], max_new_tokens=5, temperature=1.0, seed=5, speculative=0)


@pytest.mark.parametrize("edge, same_as", [
    (dict(top_p=1e-300), dict(temperature=0.0)),  # rounds to 0 in float32: only the most likely token (was id 0)
    (dict(top_p=np.float32(1e-45)), dict(temperature=0.0)),
    (dict(top_k=2**31), dict(top_k=0)),  # above the vocabulary: off (was an int32 overflow failing the batch)
    (dict(top_k=2**63), dict(top_k=0)),
    (dict(temperature=1e39), dict(temperature=float(np.finfo(np.float32).max))),  # saturates, not inf
])
def test_edge_sampling_values(served, edge, same_as):
    engine, alone = served
    got = engine.generate([GOOD[0], Request(**{**SAMPLED, **edge}), Request(**{**SAMPLED, **same_as})])
    assert all(r.ok for r in got), [r.message for r in got]
    assert got[1].tokens == got[2].tokens and got[0].tokens == alone[0]


def test_tiny_temperature_is_greedy(served):
    """logits / 1e-38 would overflow to +inf (NaN after log_softmax); shifted by their max first, every token but
    the most likely goes to -inf: greedy, as the limit says."""
    engine, _ = served
    got = engine.generate([Request(**{**SAMPLED, "temperature": t}) for t in (1e-38, 1e-30, 5e-324, 0.0)])
    assert got[0].tokens == got[1].tokens == got[2].tokens == got[3].tokens


def test_sampling_shift_is_exactly_greedy_at_tiny_temperatures():
    import jax
    import jax.numpy as jnp

    from ds4jax.generation.sampling import sample

    logits = jnp.asarray([[5.0, 4.0, 7.0, 6.5], [0.1, 0.3, 0.2, -1.0]])
    keys = jax.random.split(jax.random.key(0), 2)
    for t in (1e-38, 1e-30, 1e-6):
        drawn = sample(logits, keys, jnp.full(2, t, jnp.float32), jnp.ones(2), jnp.zeros(2, jnp.int32))
        assert drawn.tolist() == [2, 1]


@pytest.mark.parametrize("max_new", [np.uint64(2**64 - 1), np.uint64(2**63), 2**64 - 1], ids=str)
def test_huge_max_new_tokens_is_too_long_not_a_crash(served, max_new):
    """An unsigned numpy max_new_tokens near 2^64 passes the field check (an integer >= 1), and numpy's arithmetic
    once wrapped it around in the context check, so it was admitted and crashed the call (found by a longer run of
    the fuzz above). It is PROMPT_TOO_LONG, and the batch's good requests are untouched."""
    engine, alone = served
    results = engine.generate([Request(prompt=[1, 2], max_new_tokens=max_new), *GOOD])
    assert results[0].error is ErrorCode.PROMPT_TOO_LONG, results[0]
    assert [r.tokens for r in results[1:]] == alone
