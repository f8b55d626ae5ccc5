"""A running top-m set built only from ops the Pallas Triton backend lowers.

Triton-Pallas has no sort, top_k, slicing or in-register gather/scatter; it has elementwise ops,
`where`, reductions, cumsum and broadcasting. So the running set is kept UNSORTED with an explicit
rank per slot, and updates are rank arithmetic on [m, S] comparison matrices:

  buffer (m slots): score, entry id, rank in the buffer (0 = best), under the total order `beats`.
  stage  (S slots): candidates that beat the buffer's worst score, appended in entry order; merged
                    into the buffer only when full, so most blocks cost O(S * B), not O(m * B).

All functions are pure jnp on values (no refs): they run unchanged inside the kernel, under interpret
mode, and in plain-jnp unit tests.
"""

from __future__ import annotations

import jax.numpy as jnp

# Sentinel ids: above any entry id, distinct, and buffer sentinels rank above stage sentinels,
# so a stage sentinel can never enter the buffer.
BUFFER_SENTINEL = 1 << 29
STAGE_SENTINEL = 1 << 30


def beats(s_x, j_x, s_y, j_y):
    """x ranks above y: higher score; on equal scores the lower entry id (the documented tie rule)."""
    return (s_x > s_y) | ((s_x == s_y) & (j_x < j_y))


def init_buffer(m):
    """Empty buffer: -inf sentinels with distinct ids, ranked in slot order."""
    slot = jnp.arange(m, dtype=jnp.int32)
    return jnp.full((m,), -jnp.inf, jnp.float32), BUFFER_SENTINEL + slot, slot


def init_stage(size):
    slot = jnp.arange(size, dtype=jnp.int32)
    return jnp.full((size,), -jnp.inf, jnp.float32), STAGE_SENTINEL + slot


def _exclusive_cumsum(flags):
    x = flags.astype(jnp.int32)
    return jnp.cumsum(x) - x


def merge(buf_s, buf_j, buf_r, st_s, st_j):
    """Best m of buffer [m] + stage [S] (all distinct under `beats`) -> new (buf_s, buf_j, buf_r).

    Ranks in the union decide who stays; each evicted buffer slot takes one entering stage element
    (the p-th evicted slot by slot order gets the p-th entering element by stage order).
    """
    m, size = buf_s.shape[0], st_s.shape[0]
    a_over_b = beats(buf_s[:, None], buf_j[:, None], st_s[None, :], st_j[None, :])  # [m, S]
    b_over_b = beats(st_s[:, None], st_j[:, None], st_s[None, :], st_j[None, :])  # [S, S]: row v above col u
    rank_b = jnp.sum(a_over_b.astype(jnp.int32), axis=0) + jnp.sum(b_over_b.astype(jnp.int32), axis=0)  # [S]
    rank_a = buf_r + (size - jnp.sum(a_over_b.astype(jnp.int32), axis=1))  # [m]: + stage elements above it
    enter = rank_b < m  # [S]
    evict = rank_a >= m  # [m]; as many as `enter`
    match = (
        evict[:, None] & enter[None, :] & (_exclusive_cumsum(evict)[:, None] == _exclusive_cumsum(enter)[None, :])
    )  # [m, S]
    take = jnp.sum(match.astype(jnp.int32), axis=1) > 0  # [m]
    new_s = jnp.sum(jnp.where(match, st_s[None, :], 0.0), axis=1)
    new_j = jnp.sum(jnp.where(match, st_j[None, :], 0), axis=1)
    new_r = jnp.sum(jnp.where(match, rank_b[None, :], 0), axis=1)
    return jnp.where(take, new_s, buf_s), jnp.where(take, new_j, buf_j), jnp.where(take, new_r, rank_a)


def stage_append(st_s, st_j, n, s, j, take):
    """Append the `take` elements of (s [B], j [B]) after the first n stage slots, keeping their order.

    The caller guarantees n + sum(take) <= S.
    """
    size = st_s.shape[0]
    pos = n + _exclusive_cumsum(take)  # [B]
    hit = take[None, :] & (pos[None, :] == jnp.arange(size, dtype=jnp.int32)[:, None])  # [S, B]
    got = jnp.sum(hit.astype(jnp.int32), axis=1) > 0  # [S]
    new_s = jnp.sum(jnp.where(hit, s[None, :], 0.0), axis=1)
    new_j = jnp.sum(jnp.where(hit, j[None, :], 0), axis=1)
    n_new = n + jnp.sum(take.astype(jnp.int32))
    return jnp.where(got, new_s, st_s), jnp.where(got, new_j, st_j), n_new
