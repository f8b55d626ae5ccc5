"""RMSNorm variants (spec §3.1): statistics in float32, one cast back to the input dtype."""

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Weighted RMSNorm; the (float32) weight multiplies in float32 before the single cast."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * x32).astype(x.dtype)


def unweighted_rms_norm(x: jax.Array, eps: float) -> jax.Array:
    """Per-head query norm: the reciprocal RMS is computed in float32, cast, then multiplied (as HF does)."""
    inv = jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True) + eps)
    return x * inv.astype(x.dtype)
