"""Sinkhorn projection — the specification (pure jnp; the same steps as ds4jax's `mhc.sinkhorn`).

For each token's logits L [m, m] (row i, column j):
  C = softmax(L, over j) + eps;  C /= (column sums + eps)
  then (iters - 1) times:  C /= (row sums + eps);  C /= (column sums + eps)
The result is (close to) doubly stochastic. Letters: m streams; any leading dims are tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sinkhorn_reference(logits, *, iters: int, eps: float, block_sizes=None, interpret=False):
    """logits [..., m, m] -> [..., m, m] float32."""
    del block_sizes, interpret
    rows = lambda c: jnp.sum(c, axis=-1, keepdims=True)  # noqa: E731
    cols = lambda c: jnp.sum(c, axis=-2, keepdims=True)  # noqa: E731
    comb = jax.nn.softmax(logits.astype(jnp.float32), axis=-1) + eps
    comb = comb / (cols(comb) + eps)

    def step(_, c):
        c = c / (rows(c) + eps)
        return c / (cols(c) + eps)

    return jax.lax.fori_loop(0, iters - 1, step, comb)
