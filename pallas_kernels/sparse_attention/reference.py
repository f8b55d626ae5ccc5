"""Sparse MQA attention with a sink — the specification (pure jnp), plus the log-sum-exp merge rule.

Spec §3.4: one shared K=V head for all h query heads; logits (Q_h . K_j) * scale in f32;
p_j = exp(l_j) / (sum_valid exp(l) + exp(sink_h)) — the sink is in the denominator only.
Letters: t query tokens, h heads, d head dim, n list slots (na + nb), r pool rows.

Partials (used by the split kernel): over any subset of a token's rows,
  m   = max_j l_j                (-inf when the subset has no valid row)
  den = sum_j exp(l_j - m)
  acc = sum_j exp(l_j - m) K_j   (f32)
Partials over disjoint subsets merge exactly with `merge_partials`; `finalize_partials` adds the sink.
"""

from __future__ import annotations

import jax.numpy as jnp


def _gather_rows(kv, idx, kv_scale=None):
    """kv [r, d], idx [t, n] (-1 = unused) -> rows [t, n, d] f32 (0 where unused), valid [t, n]. An FP8 pool is
    dequantized after the gather: value * kv_scale [r] of its row."""
    valid = idx >= 0
    if kv.shape[0] == 0:  # an empty pool can only be referenced by -1 slots
        return jnp.zeros((*idx.shape, kv.shape[1]), jnp.float32), valid
    at = jnp.where(valid, idx, 0)
    rows = kv[at].astype(jnp.float32)
    if kv_scale is not None:
        rows = rows * kv_scale[at][..., None]
    # where, not a 0/1 multiply: row 0 may hold NaN (an unused pool row) and NaN * 0 = NaN.
    return jnp.where(valid[..., None], rows, 0.0), valid


def attention_partials_reference(q, kv, idx, *, scale, kv_scale=None):
    """Partials of one row list. q [t, h, d], kv [r, d], idx [t, n] -> acc [t, h, d] f32, m [t, h], den [t, h]."""
    rows, valid = _gather_rows(kv, idx, kv_scale)
    logits = jnp.einsum("thd,tnd->thn", q.astype(jnp.float32), rows, precision="highest") * scale
    logits = jnp.where(valid[:, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, initial=-jnp.inf)
    e = jnp.exp(logits - _finite_or_zero(m)[..., None])  # exp(-inf) = 0 for unused slots
    acc = jnp.einsum("thn,tnd->thd", e, rows, precision="highest")
    return acc, m, jnp.sum(e, axis=-1)


def merge_partials(acc, m, den, axis=0):
    """Merge partials stacked along `axis` (acc [..., d] has one more trailing dim than m, den)."""
    m_all = jnp.max(m, axis=axis, keepdims=True)
    w = jnp.exp(m - _finite_or_zero(m_all))  # 0 for empty partials (m = -inf)
    acc = jnp.sum(acc * w[..., None], axis=axis)  # acc of an empty partial is 0, never NaN
    return acc, jnp.squeeze(m_all, axis), jnp.sum(den * w, axis=axis)


def finalize_partials(acc, m, den, sink, out_dtype):
    """acc [t, h, d], m, den [t, h], sink [h] -> out [t, h, d]: add exp(sink) to the denominator.

    A token with no valid rows has acc = 0 and gets 0 (its denominator is exp(sink) > 0).
    """
    m0 = _finite_or_zero(m)
    den = den + jnp.exp(sink.astype(jnp.float32)[None, :] - m0)
    return (acc / den[..., None]).astype(out_dtype)


def sparse_attention_reference(q, kv_a, idx_a, kv_b, idx_b, sink, *, scale, kv_a_scale=None, kv_b_scale=None,
                               a_base=None, block_sizes=None, interpret=False):
    """Attention of each token over the valid rows of A and B (see module docstring).

    Args:
      q: [t, h, d] bf16/f32. kv_a: [ra, d]. idx_a: [t, na] i32 (-1 unused). kv_b: [rb, d].
      idx_b: [t, nb] i32 (-1 unused; nb may be 0). sink: [h] f32. scale: logit scale (1/sqrt(d) in V4).
      kv_a_scale, kv_b_scale: [ra] / [rb] f32 row scales of an FP8 E4M3 pool (row = value * scale), else None.
      a_base: None, or an int32 scalar added to every valid slot of idx_a (list A's rows counted from a_base).
      block_sizes, interpret: ignored (same signature as the kernel).
    Returns:
      out: [t, h, d] in q.dtype.
    """
    del block_sizes, interpret
    if a_base is not None:
        idx_a = jnp.where(idx_a >= 0, idx_a + a_base, -1)
    rows_a, valid_a = _gather_rows(kv_a, idx_a, kv_a_scale)
    rows_b, valid_b = _gather_rows(kv_b, idx_b, kv_b_scale)
    rows = jnp.concatenate([rows_a, rows_b], axis=1)  # [t, n, d]
    valid = jnp.concatenate([valid_a, valid_b], axis=1)  # [t, n]
    logits = jnp.einsum("thd,tnd->thn", q.astype(jnp.float32), rows, precision="highest") * scale
    logits = jnp.where(valid[:, None, :], logits, -jnp.inf)
    sink = sink.astype(jnp.float32)[None, :]
    m = jnp.maximum(jnp.max(logits, axis=-1, initial=-jnp.inf), sink)  # finite: includes the sink
    e = jnp.exp(logits - m[..., None])
    p = e / (jnp.sum(e, axis=-1) + jnp.exp(sink - m))[..., None]
    return jnp.einsum("thn,tnd->thd", p, rows, precision="highest").astype(q.dtype)


def _finite_or_zero(m):
    """Shift to subtract inside exp: m itself, or 0 where m = -inf (avoids -inf - -inf = NaN)."""
    return jnp.where(jnp.isneginf(m), 0.0, m)


__all__ = [
    "attention_partials_reference",
    "finalize_partials",
    "merge_partials",
    "sparse_attention_reference",
]
