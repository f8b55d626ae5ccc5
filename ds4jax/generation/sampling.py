"""Token sampling: greedy, temperature and nucleus (top-p), with per-request keys."""

import jax
import jax.numpy as jnp


def filter_logits(logits: jax.Array, temperature: jax.Array, top_p: jax.Array) -> jax.Array:
    """Scaled, nucleus-filtered log-probabilities [..., v] (float32). temperature > 0, top_p in (0, 1]."""
    scaled = logits.astype(jnp.float32) / temperature[..., None]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logp = jax.nn.log_softmax(jnp.take_along_axis(scaled, order, axis=-1), axis=-1)
    before = jnp.cumsum(jnp.exp(sorted_logp), axis=-1) - jnp.exp(sorted_logp)  # mass strictly above each token
    keep_sorted = (before < top_p[..., None]) | (top_p[..., None] >= 1.0)  # always keeps the most likely token
    keep = jnp.zeros_like(keep_sorted).at[..., order].set(keep_sorted) if scaled.ndim == 1 else \
        jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)
    return jax.nn.log_softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)


def sample(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_p: jax.Array) -> jax.Array:
    """logits [b, v], keys [b] (typed PRNG keys), temperature/top_p [b]; temperature 0 means greedy."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    safe_t = jnp.where(temperature > 0, temperature, 1.0)
    logp = filter_logits(logits, safe_t, top_p)
    drawn = jax.vmap(jax.random.categorical)(keys, logp).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)
