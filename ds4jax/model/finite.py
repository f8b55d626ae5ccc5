"""Numerics guard: turn NaN / Inf logits into `NonFiniteError` naming the first layer that produced them.

Checking is cheap where the logits are already reduced on the device (`generate(..., check_finite=True)` folds
one ``isfinite(...).all()`` into its sampling step); locating the culprit is not, so it runs only after a check
failed: one cache-free forward over the same tokens, scanning the embedding, every layer's streams and the
logits in order. On by default in the ``ds4jax`` command, off by default in the Python API (hot loops).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.errors import NonFiniteError
from ds4jax.model import forward as _forward
from ds4jax.model.handle import Model


@functools.partial(jax.jit, static_argnums=0)
def _finite_per_stage(cfg, params, token_ids):
    """[embedding, layer 0 .. layer n-1, logits]: True where every value is finite."""
    out = _forward.forward_full(cfg, params, token_ids)
    stages = [_forward.embed(params, token_ids, cfg), *out.hidden, out.logits]
    return jnp.stack([jnp.isfinite(s).all() for s in stages])


def first_nonfinite(model: Model, token_ids) -> str | None:
    """Name of the first stage ("embedding", "layer i", "logits") whose output holds NaN/Inf, or None."""
    ids = np.asarray(token_ids, np.int32).reshape(1, -1)  # into the jit as numpy: a transfer, no identity program
    ok = np.asarray(_finite_per_stage(model.config, model.params, ids))
    if ok.all():
        return None
    i = int(np.argmin(ok))
    return "embedding" if i == 0 else "logits" if i == len(ok) - 1 else f"layer {i - 1}"


def nonfinite_error(model: Model, token_ids, where: str = "") -> NonFiniteError:
    """The error to raise when logits for `token_ids` (one row) were found non-finite."""
    stage = first_nonfinite(model, token_ids)
    context = f" ({where})" if where else ""
    if stage is None:  # the cache-free forward is finite: the pooled path diverged
        return NonFiniteError(f"NaN/Inf logits{context}, but a cache-free forward over the same "
                              f"{len(token_ids)} tokens is finite: the pooled steps produced them", name="logits")
    return NonFiniteError(f"NaN/Inf values first appear here{context}, after {len(token_ids)} tokens; the weights "
                          "or the activations overflow (try float32, or check the checkpoint with "
                          "`ds4jax.load(..., check_finite=True)`)", name=stage)
