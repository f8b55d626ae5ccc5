"""Dense projections. Weights are [in, out]; accumulation is float32, one cast to the activation dtype."""

import jax
import jax.numpy as jnp


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    y = jnp.einsum("...i,io->...o", x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def linear_f32(x: jax.Array, w: jax.Array) -> jax.Array:
    """A projection whose result stays float32 (router logits, indexer head weights)."""
    return jnp.einsum("...i,io->...o", x, w.astype(x.dtype), preferred_element_type=jnp.float32)
