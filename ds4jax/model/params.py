"""Parameter declaration: every weight described once (shape, dtype, logical axes, initializer).

Flax is the declaration vocabulary here: initializers are `flax.linen.initializers` (imported from
`jax.nn.initializers`, which flax re-exports: the CLI's generate path then never imports flax), logical axes are
resolved to shardings with `flax.linen` logical-axis rules. From the one description `declare(cfg)` derive:

* `abstract(cfg, dtype)`  -> tree of `jax.ShapeDtypeStruct` (loader targets, `eval_shape` tests),
* `logical_axes(cfg)`     -> tree of logical axis-name tuples (sharding),
* `init(cfg, key, dtype)` -> random params (the embedded default model, tests).

Layout (linears are stored ``[in, out]``, the JAX/Flax kernel convention; the loader transposes checkpoint
``[out, in]`` tensors; the mHC ``fn`` stays ``[out, in]`` as the checkpoint has it, see `mhc.raw_mixes`):

    embed [v, e]   head [e, v]   norm [e]   hc_head {fn [m, m*e], base [m], scale [1]}
    layers[i]:
      attn_norm, ffn_norm [e]
      hc_attn, hc_ffn {fn [(2+m)*m, m*e], base [(2+m)*m], scale [3]}
      attn: wq_a [e, l]  q_norm [l]  wq_b [l, h*d]  wkv [e, d]  kv_norm [d]
            wo_a [g, h*d/g, o]  wo_b [g*o, e]  sink [h]
            compressor (CSA/HCA): wkv, wgate [e, c*d]  ape [ratio, c*d]  norm [d]      (c = 2 for CSA, 1 for HCA)
            indexer (CSA): wq_b [l, hi*di]  weights_proj [e, hi]
                           compressor: wkv, wgate [e, 2*di]  ape [ratio, 2*di]  norm [di]
      ffn: gate [e, x]  bias [x] (top-k layers) | tid2eid [v, k] int32 (hash layers)
           experts {w1, w3 [x, e, f], w2 [x, f, e]}   shared {w1, w3 [e, f], w2 [f, e]}
    mtp: enorm, hnorm, norm [e]  e_proj, h_proj [e, e]  hc_head {...}  block (a sliding, top-k layer as above)

Logical axes: every dimension of every parameter is named from `PARAM_AXES` (one name per dimension, no
``None``); `ds4jax.runtime.mesh` maps the names onto mesh axes with Flax logical-axis rules. Names say what
the dimension is, so one rule moves every parameter that shares it (e.g. ``heads`` = wq_b's head-major
columns and the per-head sinks; ``o_groups`` = wo_a's groups and wo_b's group-major rows).

Norm weights, mHC parameters, sinks, positional biases and router biases are always float32 (spec §5.2);
`tid2eid` is int32; everything else takes the requested compute dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.nn import initializers  # = flax.linen.initializers, without importing flax (~0.4 s)

from ds4jax.model.config import AttentionType, Config, MlpType

Initializer = Callable[..., jax.Array]


# The logical-axis vocabulary of parameters (what each name denotes is in the layout table above).
PARAM_AXES = frozenset({
    "vocab", "embed", "mtp_in", "hc_embed", "hc_mix", "hc_scale",
    "q_lora", "heads", "head_dim", "o_groups", "o_group_in", "o_lora",
    "compress_ratio", "compress_width", "index_heads", "index_head_dim",
    "router", "experts", "expert_mlp", "mlp", "hash_vocab", "top_k",
})


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    shape: tuple[int, ...]
    axes: tuple[str, ...]  # one logical axis name (from PARAM_AXES) per dimension
    init: Initializer
    fp32: bool = False  # kept in float32 whatever the compute dtype
    integer: bool = False  # int32 table (tid2eid)

    def __post_init__(self):
        named = len(self.axes) == len(self.shape) and set(self.axes) <= PARAM_AXES
        if not named or len(set(self.axes)) != len(self.axes):
            raise ValueError(f"parameter of shape {self.shape} has logical axes {self.axes}: need one distinct name "
                             f"from PARAM_AXES per dimension")

    def dtype(self, compute_dtype: Any) -> Any:
        if self.integer:
            return jnp.int32
        return jnp.float32 if self.fp32 else compute_dtype


def _is_info(x: Any) -> bool:
    return isinstance(x, ParamInfo)


_normal = initializers.normal(0.02)
_ones = initializers.ones
_zeros = initializers.zeros


def _small_normal(std: float) -> Initializer:
    return initializers.normal(std)


def _linear(fan_in: int, fan_out: int, axes: tuple[str, str]) -> ParamInfo:
    return ParamInfo((fan_in, fan_out), axes, _normal)


def _transposed(init: Initializer) -> Initializer:
    """`init` drawn for the reversed shape, then transposed: the mHC fn's values are the ones the [m*e, outputs]
    layout of earlier versions drew from the same key (every random model, and every test seed picked for its
    margins, stays the same model)."""
    return lambda key, shape, dtype=jnp.float32: init(key, shape[::-1], dtype).T


def _norm(dim: int, axis: str) -> ParamInfo:
    return ParamInfo((dim,), (axis,), _ones, fp32=True)


def _hc(cfg: Config, outputs: int, scales: int) -> dict[str, ParamInfo]:
    m, e = cfg.hc_mult, cfg.hidden_size
    return {
        "fn": ParamInfo((outputs, m * e), ("hc_mix", "hc_embed"), _transposed(_normal), fp32=True),
        "base": ParamInfo((outputs,), ("hc_mix",), _small_normal(0.1), fp32=True),
        "scale": ParamInfo((scales,), ("hc_scale",), _ones, fp32=True),
    }


def _compressor(cfg: Config, width: int, ratio: int, overlap: bool, width_axis: str) -> dict[str, ParamInfo]:
    c = 2 if overlap else 1
    e = cfg.hidden_size
    return {
        "wkv": _linear(e, c * width, ("embed", "compress_width")),
        "wgate": _linear(e, c * width, ("embed", "compress_width")),
        "ape": ParamInfo((ratio, c * width), ("compress_ratio", "compress_width"), _small_normal(0.5), fp32=True),
        "norm": _norm(width, width_axis),
    }


def _attention(cfg: Config, kind: AttentionType) -> dict[str, Any]:
    e, h, d, l = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank
    g, o = cfg.o_groups, cfg.o_lora_rank
    p: dict[str, Any] = {
        "wq_a": _linear(e, l, ("embed", "q_lora")),
        "q_norm": _norm(l, "q_lora"),
        "wq_b": _linear(l, h * d, ("q_lora", "heads")),  # head-major: sharding it splits whole heads
        "wkv": _linear(e, d, ("embed", "head_dim")),
        "kv_norm": _norm(d, "head_dim"),
        "wo_a": ParamInfo((g, h * d // g, o), ("o_groups", "o_group_in", "o_lora"), _normal),
        "wo_b": _linear(g * o, e, ("o_groups", "embed")),  # group-major rows: splits like wo_a's groups
        "sink": ParamInfo((h,), ("heads",), _small_normal(1.0), fp32=True),
    }
    if kind is AttentionType.CSA:
        p["compressor"] = _compressor(cfg, d, cfg.csa_ratio, overlap=True, width_axis="head_dim")
        p["indexer"] = {
            "wq_b": _linear(l, cfg.index_num_heads * cfg.index_head_dim, ("q_lora", "index_heads")),
            "weights_proj": _linear(e, cfg.index_num_heads, ("embed", "index_heads")),
            "compressor": _compressor(cfg, cfg.index_head_dim, cfg.csa_ratio, overlap=True,
                                      width_axis="index_head_dim"),
        }
    elif kind is AttentionType.HCA:
        p["compressor"] = _compressor(cfg, d, cfg.hca_ratio, overlap=False, width_axis="head_dim")
    return p


def _tid2eid_init(num_experts: int) -> Initializer:
    def init(key, shape, dtype=jnp.int32):
        # Distinct experts per token: argsort of uniform noise, first k columns.
        noise = jax.random.uniform(key, (shape[0], num_experts))
        return jnp.argsort(noise, axis=-1)[:, : shape[1]].astype(dtype)

    return init


def _ffn(cfg: Config, kind: MlpType) -> dict[str, Any]:
    e, x, f, k = cfg.hidden_size, cfg.num_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    p: dict[str, Any] = {
        "gate": _linear(e, x, ("embed", "router")),  # every device scores every expert
        "experts": {
            "w1": ParamInfo((x, e, f), ("experts", "embed", "expert_mlp"), _normal),
            "w3": ParamInfo((x, e, f), ("experts", "embed", "expert_mlp"), _normal),
            "w2": ParamInfo((x, f, e), ("experts", "expert_mlp", "embed"), _normal),
        },
        "shared": {
            "w1": _linear(e, f, ("embed", "mlp")),
            "w3": _linear(e, f, ("embed", "mlp")),
            "w2": _linear(f, e, ("mlp", "embed")),
        },
    }
    if kind is MlpType.HASH:
        p["tid2eid"] = ParamInfo((cfg.vocab_size, k), ("hash_vocab", "top_k"), _tid2eid_init(x), integer=True)
    else:
        p["bias"] = ParamInfo((x,), ("router",), _small_normal(0.1), fp32=True)
    return p


def _block(cfg: Config, attention: AttentionType, mlp: MlpType) -> dict[str, Any]:
    m = cfg.hc_mult
    return {
        "attn_norm": _norm(cfg.hidden_size, "embed"),
        "ffn_norm": _norm(cfg.hidden_size, "embed"),
        "hc_attn": _hc(cfg, (2 + m) * m, 3),
        "hc_ffn": _hc(cfg, (2 + m) * m, 3),
        "attn": _attention(cfg, attention),
        "ffn": _ffn(cfg, mlp),
    }


def declare(cfg: Config) -> dict[str, Any]:
    """The full parameter description of the target model (and its MTP block when the config has one)."""
    e, v, m = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    tree: dict[str, Any] = {
        "embed": ParamInfo((v, e), ("vocab", "embed"), _normal),
        "head": _linear(e, v, ("embed", "vocab")),
        "norm": _norm(e, "embed"),
        "hc_head": _hc(cfg, m, 1),
        "layers": [_block(cfg, a, f) for a, f in zip(cfg.attention_types, cfg.mlp_types)],
    }
    if cfg.num_mtp_layers:
        tree["mtp"] = {
            "enorm": _norm(e, "embed"),
            "hnorm": _norm(e, "embed"),
            "norm": _norm(e, "embed"),
            "e_proj": _linear(e, e, ("mtp_in", "embed")),
            "h_proj": _linear(e, e, ("mtp_in", "embed")),
            "hc_head": _hc(cfg, m, 1),
            "block": _block(cfg, AttentionType.SLIDING, MlpType.TOPK),
        }
    return tree


def abstract(cfg: Config, dtype: Any = jnp.bfloat16) -> Any:
    return jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype(dtype)), declare(cfg), is_leaf=_is_info)


def logical_axes(cfg: Config) -> Any:
    return jax.tree.map(lambda p: p.axes, declare(cfg), is_leaf=_is_info)


def init(cfg: Config, key: jax.Array, dtype: Any = jnp.float32) -> Any:
    """Random parameters. Biases, sinks, mHC bases and tid2eid are non-trivial so every code path is live."""
    decl = declare(cfg)
    leaves, treedef = jax.tree.flatten(decl, is_leaf=_is_info)
    keys = jax.random.split(key, len(leaves))
    arrays = [p.init(k, p.shape, p.dtype(dtype)) for p, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, arrays)


def count(params: Any) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
