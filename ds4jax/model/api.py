"""Small public conveniences over the pure functions."""

import functools

import jax
import jax.numpy as jnp

from ds4jax.compilation_cache import ensure_compilation_cache
from ds4jax.model import forward as _model
from ds4jax.errors import ArgumentError
from ds4jax.model.handle import Model
from ds4jax.model.inputs import check_token_ids


@functools.partial(jax.jit, static_argnums=0)
def _forward(cfg, params, token_ids):
    if token_ids.ndim == 1:  # one sequence: its batch axis added and dropped inside the program (each of those
        return _model.forward(cfg, params, token_ids[None])[0]  # outside it would compile a program per shape)
    return _model.forward(cfg, params, token_ids)


def forward_logits(model: Model, token_ids) -> jax.Array:
    """Full-sequence forward without a cache: token_ids [b, t] (or [t]) -> float32 logits [b, t, v] (or [t, v]).

    Ids are checked on the host (`ArgumentError` for a float, empty, out-of-vocabulary or negative id, a rank
    other than 1 or 2, or more positions than ``max_position_embeddings``); traced ids (inside jit) are not."""
    ensure_compilation_cache()
    if isinstance(token_ids, jax.core.Tracer):
        ids = jnp.asarray(token_ids, jnp.int32)
    else:  # numpy until the program: `jnp.asarray` of numpy compiles an identity program per shape (jax 0.10+)
        ids = check_token_ids(token_ids, model.config.vocab_size)
        if ids.ndim not in (1, 2):
            raise ArgumentError("must be [tokens] or [batch, tokens]", name="token_ids", value=ids.shape)
        if ids.shape[-1] > model.config.max_position_embeddings:
            raise ArgumentError(f"more positions than max_position_embeddings ({model.config.max_position_embeddings})",
                                name="token_ids", value=ids.shape)
    if model.layout is not None:  # placed on a mesh (runtime floor; duck-typed to keep imports downward)
        return model.layout.forward_logits(model, ids)
    return _forward(model.config, model.params, ids)
