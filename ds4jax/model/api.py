"""Small public conveniences over the pure functions."""

import functools

import jax
import jax.numpy as jnp

from ds4jax.model import forward as _model
from ds4jax.model.handle import Model


@functools.partial(jax.jit, static_argnums=0)
def _forward(cfg, params, token_ids):
    return _model.forward(cfg, params, token_ids)


def forward_logits(model: Model, token_ids) -> jax.Array:
    """Full-sequence forward without a cache: token_ids [b, t] (or [t]) -> float32 logits [b, t, v] (or [t, v])."""
    if model.layout is not None:  # placed on a mesh (runtime floor; duck-typed to keep imports downward)
        return model.layout.forward_logits(model, token_ids)
    ids = jnp.asarray(token_ids, jnp.int32)
    if ids.ndim == 1:
        return _forward(model.config, model.params, ids[None])[0]
    return _forward(model.config, model.params, ids)
