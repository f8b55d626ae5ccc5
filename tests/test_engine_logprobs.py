"""`Engine(logprobs=N)`: every emitted token's log-probability and top-N alternatives, from the prefill's first
token, plain decode steps, speculative rounds and a snapshot restore, equal log_softmax of `forward_logits` over
the prompt and the continuation (the raw model distribution, fp32, default model); sampling filters do not change
them; an engine without logprobs refuses requests that ask."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ds4jax
from ds4jax import Engine, ErrorCode, Request
from ds4jax.io import default_model as dm

N = 4
pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(dm.SHIPPED, "config.json")),
                                reason="checkpoints/default is not present")


@pytest.fixture(scope="module")
def model():
    return ds4jax.default_model(jnp.float32)


def reference(model, prompt, tokens):
    """log_softmax of the full forward's logits at the positions that chose each token: [T, vocab]."""
    logits = ds4jax.forward_logits(model, np.asarray([list(prompt) + list(tokens)], np.int32))[0]
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))[len(prompt) - 1: len(prompt) - 1 + len(tokens)]


def check(result, ref, n):
    got = np.array([t.logprob for t in result.logprobs])
    want = ref[np.arange(len(result.tokens)), result.tokens]
    np.testing.assert_allclose(got, want, atol=1e-5)
    top_ids = np.array([[i for i, _ in t.top] for t in result.logprobs])
    top = np.array([[v for _, v in t.top] for t in result.logprobs])
    assert top_ids.shape == (len(result.tokens), n)
    np.testing.assert_allclose(top, np.take_along_axis(ref, top_ids, axis=1), atol=1e-5)
    np.testing.assert_allclose(top, -np.sort(-ref, axis=1)[:, :n], atol=1e-5)  # the n best, best first


def test_logprobs_equal_the_full_forward(model):
    heldout = np.load(os.path.join(dm.SHIPPED, "heldout_eval.npy"))
    prompt = [int(t) for t in heldout[0, :24]]
    engine = Engine(model, max_slots=4, max_context=96, speculative=2, prefill_chunk=32, row_buckets=(4,),
                    prefill_row_buckets=(4,), steps_per_call=4, logprobs=N)
    requests = [Request(prompt=prompt, max_new_tokens=20, logprobs=N),  # speculative rounds (greedy)
                Request(prompt=prompt, max_new_tokens=20, logprobs=2, speculative=0),  # plain decode steps
                Request(prompt=prompt, max_new_tokens=20, logprobs=N, speculative=0, temperature=0.7, top_k=3,
                        seed=5),  # sampled: still the raw distribution's values
                Request(prompt=prompt, max_new_tokens=20)]  # asks for none: none recorded
    spec, plain, sampled, silent = engine.generate(requests)
    assert all(r.ok for r in (spec, plain, sampled, silent))
    assert spec.tokens == plain.tokens == silent.tokens and silent.logprobs is None
    assert sum(spec.accepted_per_round) > 0  # the rounds really accepted drafts
    ref = reference(model, prompt, spec.tokens)
    check(spec, ref, N)
    check(plain, ref, 2)
    check(sampled, reference(model, prompt, sampled.tokens), N)
    assert sampled.to_json()["logprobs"][0]["logprob"] == sampled.logprobs[0].logprob

    # a snapshot restore samples the first token from the saved logits: the same values
    first = engine.generate([Request(prompt=prompt, max_new_tokens=3, logprobs=N, speculative=0, snapshot=True)])[0]
    again = engine.generate([Request(prompt=prompt, max_new_tokens=3, logprobs=N, speculative=0)])[0]
    assert engine.stats.snapshot_hits == 1 and again.prefill_tokens == 0
    assert again.logprobs == first.logprobs and again.tokens == spec.tokens[:3]
    check(again, ref[:3], N)

    events = list(engine.stream([Request(prompt=prompt, max_new_tokens=2, logprobs=1, speculative=0)]))
    assert [e.logprob for e in events] == engine.last_results[0].logprobs
    too_many = engine.generate([Request(prompt=prompt, logprobs=N + 1)])[0]
    assert too_many.error is ErrorCode.INVALID_REQUEST and "logprobs" in too_many.message


def test_an_engine_without_logprobs_refuses_them(model):
    # the module's model (already loaded): the refusal is the request check's, no program runs for it
    engine = Engine(model, max_slots=1, max_context=16)
    res = engine.generate([Request(prompt=[1, 2], max_new_tokens=2, logprobs=0)])[0]
    assert res.error is ErrorCode.INVALID_REQUEST and "Engine(logprobs=N)" in res.message


@pytest.mark.parametrize("n", [-1, "vocab+1"])
def test_engine_logprobs_out_of_range_is_refused(model, n):
    """Negative: no engine takes it (the arguments' check, `ArgumentError`); beyond the vocabulary: this model's
    limit (`PoolError`)."""
    from ds4jax.errors import ArgumentError
    from ds4jax.runtime.pools import PoolError

    n = model.config.vocab_size + 1 if n == "vocab+1" else n
    with pytest.raises(ArgumentError if n == -1 else PoolError, match="Engine.logprobs" if n == -1 else
                       "logprobs must be in"):
        Engine(model, max_slots=1, max_context=16, logprobs=n)


def test_logprobs_on_a_layer_split_are_refused():
    """A layer split's stage programs return no logprobs: asking is a PoolError before any stage is built."""
    import types

    from ds4jax.generation import programs as programs_mod
    from ds4jax.runtime.pools import PoolError

    split = types.SimpleNamespace(num_stages=2)  # only the stage count is read before the check
    with pytest.raises(PoolError, match="layer split"):
        programs_mod.programs_for(split, None, {}, 3)
