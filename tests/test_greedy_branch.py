"""A batch in which no running row samples skips the sampling machinery (two sorts of the vocabulary and a draw per
position) in every program that samples: the decode loop, the speculative rounds (draft proposals and acceptance),
a prefill's first token and a snapshot restore. The machinery sits only inside the branch of a `lax.cond` that a
sampling row selects, and both branches give the tokens the unconditional code gave."""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import abstract_inputs
import ds4jax
from ds4jax.generation import loops, sampling, spec_rounds
from ds4jax.model import params as model_params
from ds4jax.runtime import pools, steps
from ds4jax.runtime.pool_spec import PoolSpec
from ds4jax.runtime.roles import Role

S = jax.ShapeDtypeStruct
I32 = jnp.int32
CFG = ds4jax.tiny(num_layers=1, attention_types=(ds4jax.AttentionType.SLIDING,), mlp_types=(ds4jax.MlpType.HASH,))
# what only `filter_logits` (its nucleus cumsum) and a draw (random bits) put in a program; sorts are not on the list:
# the model sorts too (MoE routing, the indexer's top-k)
SAMPLING = {"random_bits", "cumsum"}
KEYS = "random_fold_in"  # deriving a token's key from the request's seed (`sampling.token_keys`)


def _unconditional(logits, keys, temperature, top_p, top_k):
    """`sample` as it was before the branch: everything computed for every row, then picked per row."""
    logp = sampling.filter_logits(logits, jnp.where(temperature > 0, temperature, 1.0), top_p, top_k)
    drawn = jax.vmap(jax.random.categorical)(keys, logp).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits, axis=-1).astype(jnp.int32))


def _primitives(jaxpr, into_branches: bool, out=None) -> set[str]:
    """Primitives of a jaxpr and its nested jaxprs; with `into_branches` False, not those inside a `cond`'s branches
    (what runs whatever the cond decides)."""
    out = set() if out is None else out
    for eqn in jaxpr.eqns:
        out.add(eqn.primitive.name)
        if eqn.primitive.name == "cond" and not into_branches:
            continue
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            _primitives(sub.jaxpr if hasattr(sub, "jaxpr") else sub, into_branches, out)
    return out


def _assert_sampling_only_in_a_branch(fn, *args, markers=SAMPLING):
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    everywhere, unbranched = _primitives(jaxpr, True), _primitives(jaxpr, False)
    assert markers <= everywhere, everywhere  # the sampled path is compiled...
    assert not markers & unbranched, markers & unbranched  # ...and runs only when a row samples


@pytest.mark.parametrize("case", ["greedy", "sampled", "mixed", "sampled_row_not_live"])
def test_sample_equals_the_unconditional_draw(case):
    rng = np.random.default_rng(0)
    b, v = 6, 50
    logits = jnp.asarray(rng.normal(size=(b, v)) * 3, jnp.float32)
    keys = jax.random.split(jax.random.key(1), b)
    temperature = {"greedy": np.zeros(b), "sampled": np.full(b, 0.8), "mixed": np.array([0, 0.7, 0, 1.3, 0, 0.2]),
                   "sampled_row_not_live": np.array([0, 0, 0, 0, 0, 0.9])}[case].astype(np.float32)
    live = np.array([True] * 5 + [case != "sampled_row_not_live"])
    top_p = jnp.asarray(rng.uniform(0.3, 1.0, b), jnp.float32)
    top_k = jnp.asarray([0, 3, 10, 0, 1, 7], I32)
    want = np.asarray(_unconditional(logits, keys, jnp.asarray(temperature), top_p, top_k))
    got = np.asarray(sampling.sample(logits, keys, jnp.asarray(temperature), top_p, top_k, live=jnp.asarray(live)))
    np.testing.assert_array_equal(got[live], want[live])
    assert bool(sampling.none_sample(jnp.asarray(temperature), jnp.asarray(live))) == (
        case in ("greedy", "sampled_row_not_live"))


def _sample_jaxpr():
    b, v = 4, 50
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), b))
    # a new function each time: jax caches traces by function, and the branch setting is read when tracing
    return (lambda *a: sampling.sample(*a), S((b, v), jnp.float32), keys, S((b,), jnp.float32), S((b,), jnp.float32),
            S((b,), I32))


def test_sample_draws_only_in_its_branch():
    _assert_sampling_only_in_a_branch(*_sample_jaxpr())


def test_without_branching_every_row_is_drawn_as_before(monkeypatch):
    """DS4JAX_GREEDY_BRANCH=off (ROCm's choice): no cond, the sampling machinery runs unconditionally."""
    monkeypatch.setenv(sampling.BRANCH_ENV, "off")
    fn, *args = _sample_jaxpr()
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    assert "cond" not in _primitives(jaxpr, True) and SAMPLING <= _primitives(jaxpr, False)
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(4, 50)), jnp.float32)
    keys = jax.random.split(jax.random.key(2), 4)
    t, p, k = jnp.asarray([0, 0.9, 0, 1.1], jnp.float32), jnp.full(4, 0.9, jnp.float32), jnp.asarray([0, 5, 0, 0], I32)
    np.testing.assert_array_equal(sampling.sample(logits, keys, t, p, k), _unconditional(logits, keys, t, p, k))


@pytest.mark.parametrize("backend, env, want", [
    ("cpu", {}, True),  # a branch is a host jump
    ("gpu", {"XLA_FLAGS": "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"}, True),  # ds4jax's CUDA default
    ("gpu", {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="}, False),  # ROCm: command buffers off
    ("gpu", {}, False),  # XLA's default set: no CONDITIONAL, each cond a host round trip
    ("gpu", {"XLA_FLAGS": "--xla_gpu_enable_command_buffer=+CONDITIONAL,-CONDITIONAL"}, False),
    ("gpu", {"DS4JAX_GREEDY_BRANCH": "on"}, True),
    ("cpu", {"DS4JAX_GREEDY_BRANCH": "off"}, False),
])
def test_branching_where_a_cond_is_free(monkeypatch, backend, env, want):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    assert sampling.branch_on_greedy(env) is want


def test_a_bad_branch_setting_names_the_variable():
    with pytest.raises(ValueError, match=sampling.BRANCH_ENV):
        sampling.branch_on_greedy({sampling.BRANCH_ENV: "sometimes"})


def _specs(k):
    common = dict(max_slots=2, max_context=64, draft_tokens=k + 1, dtype="float32")
    return PoolSpec.for_role(CFG, role=Role.TARGET, **common), PoolSpec.for_role(CFG, role=Role.DRAFT, **common)


@pytest.mark.parametrize("program", ["decode_loop", "speculative_loop", "prefill_call", "restore_call"])
def test_engine_programs_sample_only_in_a_branch(program):
    """The dispatch itself: in each engine program that samples, the nucleus filter, the draws and the key
    derivation are inside a cond branch."""
    k = 2
    tspec, dspec = _specs(k)
    params = model_params.abstract(CFG, jnp.float32)
    kw = dict(cfg=CFG, kernels=steps.Impl.REFERENCE)
    state, rows = abstract_inputs.slot_state(CFG, 2, jnp.float32), abstract_inputs.rows(2)
    if program == "decode_loop":
        fn = functools.partial(loops.decode_loop.uncached, spec=tspec, max_steps=4, **kw)
        args = (params, pools.abstract(tspec), rows)
    elif program == "speculative_loop":
        fn = functools.partial(spec_rounds.speculative_loop.uncached, tspec=tspec, dspec=dspec, k=k, max_rounds=2,
                               **kw)
        args = (params, pools.abstract(tspec), pools.abstract(dspec), state, rows)
    elif program == "prefill_call":
        b, c = 2, 8
        fn = functools.partial(loops.prefill_call.uncached, tspec=tspec, dspec=dspec, **kw)
        args = (params, pools.abstract(tspec), pools.abstract(dspec), state, rows, S((b, c), I32),
                S((b,), I32), S((b, c), I32), S((b,), jnp.bool_))
    else:
        fn = functools.partial(loops.restore_call.uncached, dspec=dspec, **kw)
        args = (params, pools.abstract(dspec), state, rows, S((2,), jnp.bool_), S((2,), I32))
    _assert_sampling_only_in_a_branch(fn, *args, markers=SAMPLING | {KEYS})  # keys derived in the branch too


def _filter_reference(logits, temperature, top_p, top_k):
    """numpy: scale, keep the top_k most likely (0 = all) and the smallest prefix of the rest whose mass before each
    kept token is < top_p (the most likely always kept), renormalise; ties ordered by index (a stable sort)."""
    out = np.full(logits.shape, -np.inf)
    for i, row in enumerate(logits.astype(np.float64)):
        scaled = (row - row.max()) / temperature[i]
        order = np.argsort(-scaled, kind="stable")
        p = np.exp(scaled[order] - scaled.max())
        p /= p.sum()
        before = np.cumsum(p) - p
        keep = (before < top_p[i]) | (top_p[i] >= 1.0) | (np.arange(len(row)) == 0)
        if top_k[i] > 0:
            keep &= np.arange(len(row)) < top_k[i]
        kept = order[keep]
        z = scaled[kept] - np.log(np.sum(np.exp(scaled[kept])))
        out[i, kept] = z
    return out


def test_filter_logits_matches_a_numpy_reference():
    rng = np.random.default_rng(5)
    b, v = 8, 64
    logits = rng.normal(size=(b, v)).astype(np.float32) * 2
    logits[0, :10] = logits[0, 10]  # exact ties: kept or dropped by index order
    temperature = rng.uniform(0.3, 2.0, b).astype(np.float32)
    top_p = np.array([1.0, 0.9, 0.5, 0.1, 1e-9, 0.95, 0.7, 1.0], np.float32)
    top_k = np.array([0, 0, 5, 0, 0, 3, 64, 1], np.int32)
    got = np.asarray(sampling.filter_logits(jnp.asarray(logits), jnp.asarray(temperature), jnp.asarray(top_p),
                                            jnp.asarray(top_k)))
    want = _filter_reference(logits, temperature, top_p, top_k)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("branch", ["on", "off"])
def test_nothing_filtered_needs_no_sort(monkeypatch, branch):
    """top_p 1 and top_k 0 on every row (temperature sampling alone): the sorted path sits in the branch not taken,
    and both paths give the reference's log-probabilities."""
    monkeypatch.setenv(sampling.BRANCH_ENV, branch)
    rng = np.random.default_rng(6)
    b, v = 4, 64
    logits = rng.normal(size=(b, v)).astype(np.float32)
    t, p, k = rng.uniform(0.5, 1.5, b).astype(np.float32), np.ones(b, np.float32), np.zeros(b, np.int32)
    fn = lambda *a: sampling.filter_logits(*a)  # noqa: E731  (a new function: traces are cached by function)
    got = np.asarray(fn(jnp.asarray(logits), jnp.asarray(t), jnp.asarray(p), jnp.asarray(k)))
    np.testing.assert_allclose(got, _filter_reference(logits, t, p, k), rtol=1e-5, atol=1e-5)
    jaxpr = jax.make_jaxpr(lambda *a: sampling.filter_logits(*a))(logits, t, p, k).jaxpr
    assert ("sort" in _primitives(jaxpr, False)) == (branch == "off")
