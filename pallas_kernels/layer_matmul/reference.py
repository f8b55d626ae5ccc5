"""Matmul with one layer of a weight stack — the specification (pure jnp).

  y = x @ stack[layer]                      x [m, k],    stack [layers, k, n]       -> [m, n]
  y[g] = x[g] @ stack[layer, g]             x [g, m, k], stack [layers, g, k, n]    -> [g, m, n]   (grouped)

The weight in x's dtype, the products accumulated in float32.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def layer_matmul_reference(x, stack, layer, *, block_sizes=None, interpret=False):
    """The layer's weight sliced out of the stack (a dynamic slice clamps `layer`; the kernel does not check it)."""
    del block_sizes, interpret
    w = lax.dynamic_index_in_dim(stack, layer, keepdims=False).astype(x.dtype)
    spec = "gmk,gkn->gmn" if x.ndim == 3 else "mk,kn->mn"
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
