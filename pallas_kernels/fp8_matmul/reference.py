"""Dense matmul with block-scaled FP8 weights — the specification (pure jnp).

  y = x @ W,   W[i, o] = float(values[i, o]) * scales[i // bi, o // bo]   for block = (bi, bo),

with W rounded to x's dtype before the matmul (what a dequantize-then-dot computes) and f32 accumulation.
values: float8_e4m3fn (OCP) or float8_e4m3fnuz (MI300) [k, n]; scales float32 [ceil(k / bi), ceil(n / bo)].
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def dequantize_fp8(values, scales, block, dtype=jnp.float32):
    """[..., k, n] FP8 values + [..., ceil(k/bi), ceil(n/bo)] f32 scales -> [..., k, n] `dtype`."""
    *_, rows, cols = values.shape
    bi, bo = block
    s = jnp.repeat(jnp.repeat(scales, bi, axis=-2)[..., :rows, :], bo, axis=-1)[..., :cols]
    return (values.astype(jnp.float32) * s).astype(dtype)


def fp8_matmul_reference(x, values, scales, *, block, block_sizes=None, interpret=False, layer=None):
    """x [m, k] bf16/f32, values [k, n] FP8, scales [ceil(k/bi), ceil(n/bo)] f32 -> [m, n] f32; with `layer`,
    values and scales are stacks [layers, ...] and the layer's weight is used."""
    del block_sizes, interpret
    if layer is not None:
        values, scales = (lax.dynamic_index_in_dim(a, layer, keepdims=False) for a in (values, scales))
    w = dequantize_fp8(values, scales, block, x.dtype)
    return jnp.einsum("mk,kn->mn", x, w, preferred_element_type=jnp.float32)
