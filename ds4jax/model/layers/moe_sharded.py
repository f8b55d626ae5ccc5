"""Expert-parallel MoE (spec §3.9 on a mesh): routed experts split over the mesh axes the rules give
``experts`` (and their FFN columns over those of ``expert_mlp``), run inside ``shard_map`` with explicit specs.

Same result as `moe.moe`; only where the routed-expert work happens changes. Routing and the shared expert stay
automatic (GSPMD: the router is replicated, the shared expert's FFN columns follow ``mlp``). Routed experts:

1. tokens enter sharded over their batch axes (``data``). If those axes also hold different experts (experts
   over ``data`` x ``expert``, the DP-attention + EP layout), the tokens are all-gathered over them;
   otherwise every expert shard already sees the same tokens (attention is replicated across ``expert``).
2. each device runs its local experts (`moe.routed_experts` on a local view: selections of other shards get
   weight 0), so whatever strategy that function picks (ragged_dot / gather / tiles) is reused unchanged;
3. partial outputs are summed over the expert and FFN-column axes: a reduce-scatter back to the token shards
   over the gathered axes, an all-reduce over the rest.

This is the all-gather + reduce-scatter exchange. An all-to-all dispatch sends each token only to the shards of
its k experts (k = 6 of 256: on 8 shards that is ~4.5 of 8 shards per token, so no saving; past ~16 shards it
wins) but needs a static per-shard capacity; docs/mesh.md has the numbers. No device ever holds another shard's
experts: the expert weights enter the shard_map already split and are never gathered.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ds4jax.model.layer_of import resolve
from ds4jax.model.config import Config, MlpType
from ds4jax.model.layers.moe import Routing, route, routed_experts, shared_expert
from ds4jax.model import official_numerics as numerics
from ds4jax.model.sharding import Active, spec_axes


def _local_config(cfg: Config, local_experts: int) -> Config:
    # routed_experts reads num_routed_experts (group count) and the clamp; top-k comes from the routing shape.
    return cfg.replace(num_routed_experts=local_experts,
                       num_experts_per_tok=min(cfg.num_experts_per_tok, local_experts))


def routed_experts_sharded(x: jax.Array, routing: Routing, p: dict, cfg: Config, act: Active) -> jax.Array:
    """[n, e] tokens -> [n, e] float32, like `moe.routed_experts`, with the experts split over the mesh."""
    p = resolve(p)  # a scanned layer's experts arrive as `LayerOf`s (layer_of.py): sharded per layer here
    n = x.shape[0]
    w_spec = act.spec(p["w1"].shape, ("experts", "embed", "expert_mlp"))
    w2_spec = P(w_spec[0], w_spec[2], None)
    tok_spec = act.spec((n,), ("batch",))
    expert_axes, col_axes, tok_axes = spec_axes(w_spec[0]), spec_axes(w_spec[2]), spec_axes(tok_spec[0])
    # Inside a data-parallel step (``data`` already manual) the experts may also be split over ``data``: this
    # device then holds only its data shard's block of them, and the tokens of every data shard are needed.
    outer = tuple(a for a in act.full_axes(p["w1"].shape[0], "experts") if a not in act.auto)
    gather = outer + tuple(a for a in tok_axes if a in expert_axes)
    reduce = tuple(a for a in expert_axes + col_axes if a not in gather)
    all_expert_axes = outer + expert_axes
    local_cfg = _local_config(cfg, cfg.num_routed_experts // max(1, _size(act, all_expert_axes)))

    def local(xs, ids, weights, w1, w3, w2):
        if gather:
            xs, ids, weights = (jax.lax.all_gather(a, gather, axis=0, tiled=True) for a in (xs, ids, weights))
        count = w1.shape[0]
        first = (jax.lax.axis_index(all_expert_axes) * count) if all_expert_axes else 0
        mine = (ids >= first) & (ids < first + count)
        view = Routing(jnp.where(mine, ids - first, 0), jnp.where(mine, weights, 0.0))
        y = routed_experts(xs, view, {"w1": w1, "w3": w3, "w2": w2}, local_cfg)
        if reduce:
            y = jax.lax.psum(y, reduce)
        if gather:
            y = jax.lax.psum_scatter(y, gather, scatter_dimension=0, tiled=True)
        return y

    tok = P(tok_spec[0])
    fn = jax.shard_map(local, mesh=act.mesh, in_specs=(tok, tok, tok, w_spec, w_spec, w2_spec), out_specs=tok,
                       axis_names=set(act.auto), check_vma=False)
    return fn(x, routing.experts, routing.weights, p["w1"], p["w3"], p["w2"])


def _size(act: Active, axes) -> int:
    out = 1
    for a in axes:
        out *= act.sizes[a]
    return out


def moe(x: jax.Array, token_ids: jax.Array, p: dict, cfg: Config, kind: MlpType, act: Active):
    """Drop-in for `moe.moe` under a mesh: (output [..., e], routing over the flattened tokens)."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    routing = route(flat, token_ids.reshape(-1), p, cfg, kind)
    out = routed_experts_sharded(numerics.round_act(flat, cfg), routing, p["experts"], cfg, act)
    out = out + shared_expert(flat, p["shared"], cfg).astype(jnp.float32)
    return out.astype(x.dtype).reshape(shape), routing
