"""Acceptance rules of speculative decoding (`ds4jax.generation.acceptance`) on crafted inputs.

Statistical tests use fixed seeds, so they are deterministic; the stated false-failure rate is the probability,
over the choice of seed, that a correct implementation fails.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ds4jax.generation.acceptance import accept_greedy, accept_sampled
from spec_helpers import chi_square_pvalue


def _logits_with_argmax(choice: np.ndarray, v: int, seed: int = 0) -> jnp.ndarray:
    """[b, k+1, v] logits whose argmax along v is `choice` (a margin of 1 over uniform noise in [0, 0.5))."""
    noise = np.random.default_rng(seed).uniform(0, 0.5, choice.shape + (v,))
    noise[np.arange(choice.shape[0])[:, None], np.arange(choice.shape[1])[None, :], choice] += 1.0
    return jnp.asarray(noise, jnp.float32)


def test_accept_greedy_crafted():
    # target argmax at positions 0..3 is [1, 2, 3, 4] for every row; drafts differ
    k, v = 3, 6
    choice = np.tile(np.array([[1, 2, 3, 4]]), (6, 1))
    drafts = np.array([
        [1, 2, 3],  # all accepted -> bonus token = argmax at position k
        [0, 2, 3],  # first draft rejected -> correction = argmax at position 0 (later matches do not count)
        [1, 5, 3],  # second rejected, the third matches but follows a rejection
        [1, 2, 0],  # last rejected
        [5, 5, 5],  # nothing matches
        [1, 2, 4],
    ], np.int32)
    acc = jax.jit(accept_greedy)(jnp.asarray(drafts), _logits_with_argmax(choice, v))
    np.testing.assert_array_equal(np.asarray(acc.accepted), [3, 0, 1, 2, 0, 2])
    np.testing.assert_array_equal(np.asarray(acc.next_token), [4, 1, 2, 3, 1, 3])
    assert acc.accepted.dtype == jnp.int32 and acc.next_token.dtype == jnp.int32
    assert acc.accepted.shape == (6,) and acc.next_token.shape == (6,)


def test_accept_greedy_k1_per_row_targets():
    rng = np.random.default_rng(1)
    b, v = 64, 7
    choice = rng.integers(0, v, (b, 2))
    drafts = np.where(rng.uniform(size=(b, 1)) < 0.5, choice[:, :1], (choice[:, :1] + 1) % v).astype(np.int32)
    acc = accept_greedy(jnp.asarray(drafts), _logits_with_argmax(choice, v, seed=2))
    hit = drafts[:, 0] == choice[:, 0]
    np.testing.assert_array_equal(np.asarray(acc.accepted), hit.astype(int))
    np.testing.assert_array_equal(np.asarray(acc.next_token), np.where(hit, choice[:, 1], choice[:, 0]))


# ---- rejection sampling --------------------------------------------------------------------------------------

N_TRIALS = 200_000
P_THRESHOLD = 1e-4


def _distributions(k: int, v: int, seed: int):
    """Target p [k+1, v] and draft q [k, v]: Dirichlet draws, with zeros (as after top-p filtering) where the
    supports differ: p_0 never emits token 0 (but q_0 does), q_0 never proposes token v-1 (p_0 does)."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(v, 0.8), size=k + 1)
    q = rng.dirichlet(np.full(v, 0.8), size=k)
    p[0, 0] = 0.0
    q[0, v - 1] = 0.0
    q[0, 0] = max(q[0, 0], 0.2)
    return p / p.sum(-1, keepdims=True), q / q.sum(-1, keepdims=True)


@functools.partial(jax.jit, static_argnums=(3,))
def _rounds(log_p, log_q, key, n):
    """n independent rounds with prefix-independent target p_j and draft q_j: drafts d_j ~ q_j, then
    accept_sampled. Returns (accepted [n], emitted tokens completed to k+1 positions [n, k+1], controls).

    Positions after the round's last emitted token are filled with fresh draws from p_j: if the rule preserves
    the target, the completed sequence is distributed as prod_j p_j (a round emits a target-distributed prefix
    and the rest is what later rounds would produce)."""
    k = log_q.shape[0]
    kd, ka, kf, kw = jax.random.split(key, 4)
    drafts = jax.random.categorical(kd, log_q, shape=(n, k)).astype(jnp.int32)
    acc = accept_sampled(drafts, jnp.broadcast_to(log_q, (n,) + log_q.shape),
                         jnp.broadcast_to(log_p, (n,) + log_p.shape), jax.random.split(ka, n))
    fresh = jax.random.categorical(kf, log_p, shape=(n, k + 1)).astype(jnp.int32)
    j = jnp.arange(k + 1)[None, :]
    a = acc.accepted[:, None]
    padded = jnp.concatenate([drafts, jnp.zeros((n, 1), jnp.int32)], axis=1)
    full = jnp.where(j < a, padded, jnp.where(j == a, acc.next_token[:, None], fresh))
    # control: the classic bug of drawing the replacement from p instead of the residual max(0, p - q)
    wrong_next = jax.random.categorical(kw, jnp.take(log_p, acc.accepted, axis=0)).astype(jnp.int32)
    wrong = jnp.where(j < a, padded, jnp.where(j == a, wrong_next[:, None], fresh))
    return acc.accepted, full, wrong, drafts


@pytest.mark.parametrize("k", [1, 2, 3])
def test_accept_sampled_preserves_target_distribution(k):
    """Rejection sampling emits target-distributed tokens (chi-square, 200k rounds, vocab 6).

    Checked: the marginal of every position of the completed round (position 0 is the first emitted token) and
    the joint of positions 0 and 1 (v^2 cells). Each statistic fails a correct implementation with probability
    1e-4 (threshold p < 1e-4); with k+2 statistics per k, the false-failure rate of this test is <= 5e-4 per
    k (union bound), ~1.2e-3 over k = 1, 2, 3. Fixed seeds make the outcome deterministic.
    Power: the same statistics reject the draft tokens themselves and the 'replacement drawn from p' bug."""
    v = 6
    p, q = _distributions(k, v, seed=10 + k)
    with np.errstate(divide="ignore"):
        log_p, log_q = jnp.asarray(np.log(p), jnp.float32), jnp.asarray(np.log(q), jnp.float32)
    accepted, full, wrong, drafts = map(np.asarray, _rounds(log_p, log_q, jax.random.key(100 + k), N_TRIALS))

    # both outcomes occur: full acceptance, and rejection at every position
    hist = np.bincount(accepted, minlength=k + 1)
    assert (hist > 0).all(), hist
    for j in range(k + 1):
        pv = chi_square_pvalue(full[:, j], p[j])
        assert pv > P_THRESHOLD, f"position {j}: p-value {pv:.3g} (accept histogram {hist.tolist()})"
    pair = full[:, 0] * v + full[:, 1]
    pv = chi_square_pvalue(pair, np.outer(p[0], p[1]).reshape(-1))
    assert pv > P_THRESHOLD, f"joint of positions 0, 1: p-value {pv:.3g}"

    # power: the draft tokens follow q_0, not p_0 (token 0 is impossible under p_0 yet proposed), and drawing the
    # replacement from p instead of the residual (a classic bug) is rejected by the same statistic
    assert chi_square_pvalue(drafts[:, 0], q[0]) > P_THRESHOLD
    with pytest.raises(AssertionError, match="zero-probability"):
        chi_square_pvalue(drafts[:, 0], p[0])
    assert chi_square_pvalue(wrong[:, 0], p[0]) < 1e-12


def test_accept_sampled_edge_cases():
    """p == q: every draft is accepted and the bonus comes from p_k. Disjoint supports: every first draft is
    rejected and the replacement (the residual = p_0) never lies in q_0's support."""
    k, v, n = 2, 5, 4096
    rng = np.random.default_rng(3)
    p = rng.dirichlet(np.ones(v), size=k + 1)
    log_p = jnp.asarray(np.log(p), jnp.float32)
    accepted, full, _, drafts = map(np.asarray, _rounds(log_p, log_p[:k], jax.random.key(5), n))
    assert (accepted == k).all()
    np.testing.assert_array_equal(full[:, :k], drafts)

    p0 = np.array([0.5, 0.5, 0.0, 0.0, 0.0])
    q0 = np.array([0.0, 0.0, 0.2, 0.3, 0.5])
    p = np.stack([p0, np.full(v, 0.2), np.full(v, 0.2)])
    q = np.stack([q0, np.full(v, 0.2)])
    with np.errstate(divide="ignore"):
        accepted, full, _, _ = map(np.asarray, _rounds(jnp.asarray(np.log(p), jnp.float32),
                                                       jnp.asarray(np.log(q), jnp.float32), jax.random.key(6), n))
    assert (accepted == 0).all()
    assert set(np.unique(full[:, 0]).tolist()) == {0, 1}
    assert chi_square_pvalue(full[:, 0], p0) > 1e-3
