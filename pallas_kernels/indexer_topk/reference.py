"""Lightning-indexer scoring + top-k selection — the specification (pure jnp; may materialise [t, c]).

Spec §3.8: score(t, j) = sum_h w[t, h] * relu(q[t, h] . K[row(t, j)]) * di**-0.5 for visible j < n_valid[t].
Order (a total order, so results are deterministic): higher score first; equal scores -> LOWER entry j
first. -0.0 and +0.0 count as equal (ReLU and negative weights produce both).
Letters: t query tokens, h indexer heads, d indexer dim, c logical entries, k selected.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def indexer_scores_reference(q, w, keys, key_rows, n_valid, key_scale=None):
    """q [t, h, d], w [t, h] f32, keys [r, d], key_rows [t, c] i32, n_valid [t] i32 -> scores [t, c] f32.

    Entries j >= n_valid[t] score -inf; their rows are never used (gathered row 0 is selected away). FP8 keys are
    dequantized after the gather (value * key_scale [r] of the row).
    """
    t, c = key_rows.shape
    visible = jnp.arange(c, dtype=jnp.int32)[None, :] < n_valid[:, None]  # [t, c]
    if keys.shape[0] == 0:
        return jnp.full((t, c), -jnp.inf, jnp.float32)
    at = jnp.where(visible, key_rows, 0)
    rows = keys[at].astype(jnp.float32)  # [t, c, d]
    if key_scale is not None:
        rows = rows * key_scale[at][..., None]
    logits = jnp.einsum("thd,tcd->thc", q.astype(jnp.float32), rows, precision="highest")
    scores = jnp.einsum("th,thc->tc", w.astype(jnp.float32), jnp.maximum(logits, 0.0), precision="highest")
    scores = scores * q.shape[-1] ** -0.5
    return jnp.where(visible, scores, -jnp.inf)  # where, not a mask multiply: invisible rows may be NaN


def select_topk(scores, ids, k):
    """Top-k candidates by (score desc, id asc). scores [t, n] f32 (-inf = no candidate), ids [t, n] i32.

    Returns [t, k] i32 ids; slots beyond the number of finite candidates are -1.
    """
    n = scores.shape[1]
    key = jnp.where(scores == 0, 0.0, -scores)  # +inf for "no candidate"; -0.0 folded into +0.0
    key, ids = lax.sort((key, ids), dimension=1, num_keys=2)
    if n < k:
        key = jnp.pad(key, ((0, 0), (0, k - n)), constant_values=jnp.inf)
        ids = jnp.pad(ids, ((0, 0), (0, k - n)), constant_values=-1)
    return jnp.where(key[:, :k] == jnp.inf, -1, ids[:, :k]).astype(jnp.int32)


def indexer_topk_reference(q, w, keys, key_rows, n_valid, *, k, key_scale=None, block_sizes=None, interpret=False):
    """Indices of the top-min(k, n_valid) entries per query (see module docstring for the order).

    Args:
      q: [t, h, d] f32/bf16 indexer queries. w: [t, h] f32 head weights (already scaled).
      keys: [r, d] indexer-key pool (FP8 E4M3 with key_scale [r] f32). key_rows: [t, c] i32 pool row of entry j.
      n_valid: [t] i32 visible entries. k: static top-k. block_sizes, interpret: ignored.
    Returns:
      idx: [t, k] i32 logical entry ids j, best first; -1 in unused slots.
    """
    del block_sizes, interpret
    t, c = key_rows.shape
    scores = indexer_scores_reference(q, w, keys, key_rows, n_valid, key_scale)
    ids = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (t, c))
    return select_topk(scores, ids, k)
