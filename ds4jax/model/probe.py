"""What the network does inside, per layer, for plots and notebooks: attention weights over the sliding window and
the compressed entries, the indexer's picks, the hyper-connection mixing weights and the expert routing.

`probe` runs the same blocks as `forward.forward_full` (its logits are the forward's) and, in the attention
sub-layer, also returns the attention probabilities that `attention.attend` uses.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ds4jax.model.config import Config
from ds4jax.model.forward import block, embed, logits_from_streams
from ds4jax.model.layers import attention
from ds4jax.model.layers.mhc import hc_post, hc_weights
from ds4jax.model.layers.moe import Routing


class HcWeights(NamedTuple):
    """Per-token hyper-connection weights of one sub-layer (float32)."""

    pre: jax.Array  # [b, t, m]: how the m streams collapse into the sub-layer input
    post: jax.Array  # [b, t, m]: how the sub-layer output is written back to each stream
    comb: jax.Array  # [b, t, m, m]: residual stream mixing, Sinkhorn-projected (rows and columns sum to 1)


class LayerView(NamedTuple):
    """One layer of one forward. Keys are [the t positions ; n compressed entries] (n = 0 for sliding layers)."""

    probs: jax.Array  # [b, t, h, t + n] float32 attention weights (each row sums to 1 minus the sink's share)
    valid: jax.Array  # [b, t, t + n] bool: keys the query reads (window rows; causal entries, CSA: the picks)
    entries: jax.Array  # [b, t, n] bool: compressed entries complete before the query (what the indexer ranks)
    selection: jax.Array | None  # [b, t, k] int32 indexer picks, -1 = none (CSA layers), else None
    hc_attn: HcWeights
    hc_ffn: HcWeights
    routing: Routing  # experts [b*t, k] and their weights


def probe(cfg: Config, params: dict, token_ids: jax.Array) -> tuple[jax.Array, list[LayerView]]:
    """token_ids [b, t] from position 0 -> (logits [b, t, v] float32, one LayerView per layer). Jit with cfg static."""
    x = embed(params, token_ids, cfg)
    views = []
    for p, kind, mlp in zip(params["layers"], cfg.attention_types, cfg.mlp_types):
        hc_attn = HcWeights(*hc_weights(x, p["hc_attn"], cfg))

        def attn(h, p=p["attn"], kind=kind):
            s = attention.sequence_keys(h, p, cfg, kind)
            scale = cfg.head_dim**-0.5
            o = attention.attend(s.q, s.keys, s.valid, p["sink"], scale)
            y = attention.output_projection(o, s.positions, p, cfg, attention.layer_inv_freq(cfg, kind))
            return y, (y, s, attention.attention_probs(s.q, s.keys, s.valid, p["sink"], scale))

        x_next, aux = block(x, token_ids, p, cfg, mlp, attn)
        y, s, probs = aux.attention
        x_mid = hc_post(y, x, hc_attn.post, hc_attn.comb)  # the streams the FFN's hyper-connection sees
        t = token_ids.shape[1]
        n = s.keys.shape[1] - t
        ratio = cfg.compress_ratio_of(kind) or 1
        entries = jnp.arange(n)[None, None, :] < ((s.positions + 1) // ratio)[..., None]
        views.append(LayerView(probs, s.valid, entries, s.selection, hc_attn,
                               HcWeights(*hc_weights(x_mid, p["hc_ffn"], cfg)), aux.routing))
        x = x_next
    return logits_from_streams(x, params["hc_head"], params["norm"], params["head"], cfg), views

