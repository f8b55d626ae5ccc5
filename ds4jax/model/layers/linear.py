"""Dense projections. Weights are [in, out] (an array, or an FP8 `QuantizedWeight` dequantized next to the dot,
where XLA fuses the convert and the block-scale multiply into the dot's operand); accumulation is float32, one
cast to the activation dtype."""

import jax
import jax.numpy as jnp

from ds4jax.model.quantized import dense


def linear(x: jax.Array, w) -> jax.Array:
    y = jnp.einsum("...i,io->...o", x, dense(w, x.dtype), preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def linear_f32(x: jax.Array, w) -> jax.Array:
    """A projection whose result stays float32 (router logits, indexer head weights)."""
    return jnp.einsum("...i,io->...o", x, dense(w, x.dtype), preferred_element_type=jnp.float32)
