"""Lightning indexer (spec §3.8): scores compressed indexer keys against per-head queries, keeps the top-k.

score(t, w) = sum_h weight[t, h] * relu(q[t, h] . key[w]) / sqrt(di), over causal entries w < (t+1) // ratio.
Selection: top-min(index_topk, entries) by score, ties to the lower entry index; non-causal picks are -1.
"""

import jax
import jax.numpy as jnp

from ds4jax.model.config import Config
from ds4jax.model.layers.linear import linear, linear_f32
from ds4jax.model.layers.rope import apply_rope
from ds4jax.model import official_numerics as numerics


def queries(q_latent: jax.Array, x: jax.Array, positions: jax.Array, p: dict, cfg: Config, inv_freq):
    """q_latent [..., t, l], x [..., t, e] -> (q [..., t, hi, di], head weights [..., t, hi] float32).

    Under ``numerics="official"`` wq_b's input is rounded and q is Hadamard-rotated and FP4-rounded like the keys."""
    q = linear(numerics.round_act(q_latent, cfg), p["wq_b"])
    q = q.reshape(q.shape[:-1] + (cfg.index_num_heads, cfg.index_head_dim))
    q = numerics.round_index(apply_rope(q, positions, inv_freq), cfg)
    weights = linear_f32(x, p["weights_proj"]) * cfg.index_num_heads**-0.5
    return q, weights


def scores(q: jax.Array, weights: jax.Array, keys: jax.Array, cfg: Config) -> jax.Array:
    """q [b, t, hi, di], weights [b, t, hi], keys [b, c, di] -> [b, t, c] float32."""
    dots = jnp.einsum("bthd,bcd->bthc", q.astype(jnp.float32), keys.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    return jnp.einsum("bthc,bth->btc", jax.nn.relu(dots) * cfg.index_head_dim**-0.5, weights,
                      precision=jax.lax.Precision.HIGHEST)


def select(score: jax.Array, visible: jax.Array, k: int) -> jax.Array:
    """score [..., c], visible [..., c] bool -> entry ids [..., min(k, c)] (-1 where fewer are visible)."""
    c = score.shape[-1]
    k = min(k, c)
    masked = jnp.where(visible, score, -jnp.inf)
    # lax.top_k breaks ties towards the lower index, which is the documented rule.
    values, idx = jax.lax.top_k(masked, k)
    return jnp.where(values == -jnp.inf, -1, idx).astype(jnp.int32)
