"""The DeepSeek-V4 network as pure functions over a params pytree (spec §2).

`forward` is the cache-free, differentiable full-sequence forward (training, parity checks, `compare`).
The pooled prefill / decode / draft-extend steps live in `ds4jax.runtime.steps` and reuse the same blocks.
"""

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from ds4jax.model import layer_stack, sharding
from ds4jax.model.config import AttentionType, Config, MlpType
from ds4jax.model.layers.attention import attention_sequence
from ds4jax.model.layers.linear import linear
from ds4jax.model.layers.mhc import hc_head_normed, hc_post, hc_pre_normed
from ds4jax.model.layers import moe_sharded
from ds4jax.model.layers.moe import Routing, moe
from ds4jax.model.layers.norms import rms_norm
from ds4jax.model import official_numerics as numerics

# attention sub-layer: normalised input [b, t, e] -> (output [b, t, e], extra)
AttentionFn = Callable[[jax.Array], tuple[jax.Array, Any]]


class BlockAux(NamedTuple):
    routing: Routing  # expert selection over the flattened [b*t] tokens
    attention: Any  # indexer selection [b, t, n] for CSA layers, else None (or step-specific extras)


def block(x: jax.Array, token_ids: jax.Array, p: dict, cfg: Config, mlp: MlpType, attention: AttentionFn,
          routed=None, mhc_pre=None):
    """One decoder block on hyper-connection streams x [b, t, m, e] -> (x', BlockAux).

    `routed` replaces the routed-experts computation (see `moe.moe`), `mhc_pre(x, hc_params, norm_weight)` the
    hyper-connection pre-step with the sub-layer's RMSNorm (see `mhc.hc_pre_normed`); None = the model's own."""
    pre_step = mhc_pre or functools.partial(hc_pre_normed, cfg=cfg)
    post, comb, h = pre_step(x, p["hc_attn"], p["attn_norm"])
    y, attn_extra = attention(h)
    x = hc_post(y, x, post, comb)
    post, comb, h = pre_step(x, p["hc_ffn"], p["ffn_norm"])
    y, routing = _moe(h, token_ids, p["ffn"], cfg, mlp, routed)
    return hc_post(y, x, post, comb), BlockAux(routing, attn_extra)


def _moe(x, token_ids, p, cfg: Config, mlp: MlpType, routed=None):
    """`moe` (routed experts by `routed` when given), or its expert-parallel twin when traced under a mesh
    (`ds4jax.model.sharding.active`; it has its own routed-experts path)."""
    act = sharding.active()
    return moe(x, token_ids, p, cfg, mlp, routed) if act is None else moe_sharded.moe(x, token_ids, p, cfg, mlp, act)


def embed(params: dict, token_ids: jax.Array, cfg: Config) -> jax.Array:
    """[b, t] -> hyper-connection streams [b, t, m, e] (the embedding copied into every stream)."""
    e = params["embed"][token_ids]
    return jnp.broadcast_to(e[..., None, :], e.shape[:-1] + (cfg.hc_mult, e.shape[-1]))


def logits_from_streams(x: jax.Array, head_params: dict, norm: jax.Array, head: jax.Array, cfg: Config,
                        mhc_head=None) -> jax.Array:
    """[..., m, e] -> [..., v]: hc_head reduction, final RMSNorm, vocab projection (float32 logits).
    `mhc_head(x, head_params, norm)` replaces the reduction with the norm (one kernel; see `mhc.hc_head_normed`);
    None = the model's own."""
    y = (mhc_head or functools.partial(hc_head_normed, cfg=cfg))(x, head_params, norm)
    return jnp.einsum("...e,ev->...v", y, head.astype(y.dtype), preferred_element_type=jnp.float32)


class ForwardOutput(NamedTuple):
    logits: jax.Array  # [b, t, v] float32
    hidden: list  # per layer: streams after the block [b, t, m, e]
    aux: list  # per layer: BlockAux


def forward_full(cfg: Config, params: dict, token_ids: jax.Array) -> ForwardOutput:
    """Full-sequence forward of the target model from position 0 (no cache)."""
    def layer(x, p, at):
        attn = lambda h: attention_sequence(h, p["attn"], cfg, at.attention)
        x, a = block(x, token_ids, p, cfg, at.mlp, attn)
        return x, (x, a)

    x, per_layer = layer_stack.run(cfg, params["layers"], embed(params, token_ids, cfg), layer)
    hidden, aux = [h for h, _ in per_layer], [a for _, a in per_layer]
    logits = logits_from_streams(x, params["hc_head"], params["norm"], params["head"], cfg)
    return ForwardOutput(logits, hidden, aux)


def forward(cfg: Config, params: dict, token_ids: jax.Array, return_hidden: bool = False):
    """token_ids [b, t] -> logits [b, t, v] (float32); with return_hidden, also the per-layer streams."""
    out = forward_full(cfg, params, token_ids)
    return (out.logits, out.hidden) if return_hidden else out.logits


def mtp_inputs(cfg: Config, params: dict, streams: jax.Array, next_ids: jax.Array) -> jax.Array:
    """MTP block input (spec §3.11): target streams of row i [.., m, e] and the embedding of token i+1."""
    p = params["mtp"]
    e = rms_norm(params["embed"][next_ids], p["enorm"], cfg.rms_norm_eps)
    h = rms_norm(streams, p["hnorm"], cfg.rms_norm_eps)
    h, e = numerics.round_act(h, cfg), numerics.round_act(e, cfg)  # both are FP8 linears' inputs
    return linear(h, p["h_proj"]) + linear(e, p["e_proj"])[..., None, :]


def mtp_forward_full(cfg: Config, params: dict, streams: jax.Array, next_ids: jax.Array) -> ForwardOutput:
    """Cache-free MTP (draft) forward: streams [b, t, m, e] of the target's last block, next_ids [b, t]."""
    p = params["mtp"]
    x = mtp_inputs(cfg, params, streams, next_ids)
    attn = lambda h: attention_sequence(h, p["block"]["attn"], cfg, AttentionType.SLIDING)
    x, a = block(x, next_ids, p["block"], cfg, MlpType.TOPK, attn)
    logits = logits_from_streams(x, p["hc_head"], p["norm"], params["head"], cfg)
    return ForwardOutput(logits, [x], [a])
