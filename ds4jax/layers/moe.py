"""Mixture of experts (spec §3.9): sqrt-softplus router with selection bias or hash routing, clamped SwiGLU
routed experts through `jax.lax.ragged_dot`, plus the always-on shared expert.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ds4jax.config import Config, MlpType
from ds4jax.layers.linear import linear, linear_f32


class Routing(NamedTuple):
    experts: jax.Array  # [n, k] int32 selected expert ids
    weights: jax.Array  # [n, k] float32 routing weights (normalised, times routed_scaling_factor)


def route(x: jax.Array, token_ids: jax.Array, p: dict, cfg: Config, kind: MlpType) -> Routing:
    """x: [n, e] normalised tokens; token_ids: [n] (used by hash layers only)."""
    scores = jnp.sqrt(jax.nn.softplus(linear_f32(x, p["gate"])))  # [n, x]
    if kind is MlpType.HASH:
        experts = p["tid2eid"][token_ids]
    else:
        _, experts = jax.lax.top_k(scores + p["bias"].astype(jnp.float32), cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor
    return Routing(experts.astype(jnp.int32), weights)


def swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """Clamped SwiGLU: gate <= limit, up in [-limit, limit]."""
    return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


def shared_expert(x: jax.Array, p: dict, cfg: Config) -> jax.Array:
    return linear(swiglu(linear(x, p["w1"]), linear(x, p["w3"]), cfg.swiglu_limit), p["w2"])


def routed_experts(x: jax.Array, routing: Routing, p: dict, cfg: Config) -> jax.Array:
    """Grouped GEMMs over tokens sorted by expert: [n, e] -> [n, e] (float32 accumulation)."""
    n, k = routing.experts.shape
    flat_experts = routing.experts.reshape(-1)  # [n*k]
    order = jnp.argsort(flat_experts, stable=True)
    token_of = order // k
    group_sizes = jnp.bincount(flat_experts, length=cfg.num_routed_experts).astype(jnp.int32)
    xs = x[token_of]  # [n*k, e] grouped by expert
    dot = lambda a, w: jax.lax.ragged_dot(a, w.astype(a.dtype), group_sizes, preferred_element_type=jnp.float32)
    h = swiglu(dot(xs, p["w1"]), dot(xs, p["w3"]), cfg.swiglu_limit).astype(x.dtype)
    y = dot(h, p["w2"])  # [n*k, e] float32
    y = y * routing.weights.reshape(-1)[order][:, None]
    return jnp.zeros((n, x.shape[-1]), jnp.float32).at[token_of].add(y)


def moe(x: jax.Array, token_ids: jax.Array, p: dict, cfg: Config, kind: MlpType) -> tuple[jax.Array, Routing]:
    """x: [..., e]; token_ids: [...]. Returns (output [..., e], routing over the flattened tokens)."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    routing = route(flat, token_ids.reshape(-1), p, cfg, kind)
    out = routed_experts(flat, routing, p["experts"], cfg) + shared_expert(flat, p["shared"], cfg).astype(jnp.float32)
    return out.astype(x.dtype).reshape(shape), routing
