"""Frozen, hashable DeepSeek-V4 architecture config, presets and the HF ``config.json`` converter.

`Config` holds architecture (spec §1) plus `numerics`, the rounding recipe chosen at load (``ds4jax.load(...,
numerics=...)``; not part of ``config.json``). Capacities of KV pools live in `ds4jax.runtime.pool_spec.PoolSpec`;
kernel choices live in the step spec. A `Config` is a static argument of every jitted function, so every program
specialises on the numerics as on the architecture.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
from typing import Any, Mapping

from ds4jax.bounded_read import read_bytes
from ds4jax.errors import ConfigError  # noqa: F401 (re-exported: importable from here too)


class AttentionType(enum.Enum):
    SLIDING = "sliding_attention"  # ratio 0: sliding window only
    CSA = "compressed_sparse_attention"  # ratio 4: overlapping compressor + lightning indexer top-k
    HCA = "heavily_compressed_attention"  # ratio 128: non-overlapping compressor, dense over entries


class Numerics(enum.Enum):
    """Which rounding the model applies (`ds4jax.model.official_numerics`, docs/official_numerics.md)."""

    REFERENCE = "reference"  # HF transformers' numbers: no fake quantisation (the default)
    OFFICIAL = "official"  # the official inference code's QAT simulations: FP8 KV / activations, FP4 indexer

    @classmethod
    def parse(cls, value: "Numerics | str") -> "Numerics":
        """A `numerics` argument (a member or its name) -> the member; `ArgumentError` naming the choices."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            from ds4jax.errors import ArgumentError

            raise ArgumentError(f"must be one of {', '.join(repr(m.value) for m in cls)}", name="numerics",
                                value=value) from None


class MlpType(enum.Enum):
    HASH = "hash_moe"  # experts chosen by tid2eid[token_id]
    TOPK = "moe"  # experts chosen by top-k of sqrt-softplus score + bias


@dataclasses.dataclass(frozen=True, kw_only=True)
class YarnScaling:
    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    index_num_heads: int
    index_head_dim: int
    index_topk: int
    sliding_window: int
    attention_types: tuple[AttentionType, ...]
    mlp_types: tuple[MlpType, ...]
    csa_ratio: int = 4
    hca_ratio: int = 128
    num_routed_experts: int
    num_shared_experts: int = 1
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: YarnScaling | None = YarnScaling()
    max_position_embeddings: int = 1048576
    num_mtp_layers: int = 1
    bos_token_id: int = 0
    eos_token_id: int = 1
    numerics: Numerics = Numerics.REFERENCE  # a load-time choice, not architecture: never written to config.json

    def __post_init__(self):
        validate(self)

    # ---- derived quantities -------------------------------------------------------------------
    def compress_ratio(self, layer: int) -> int:
        """0 for sliding-only layers, else the layer's compression ratio."""
        return self.compress_ratio_of(self.attention_types[layer])

    def compress_ratio_of(self, kind: AttentionType) -> int:
        return {AttentionType.SLIDING: 0, AttentionType.CSA: self.csa_ratio, AttentionType.HCA: self.hca_ratio}[kind]

    def layers_of(self, kind: AttentionType) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.attention_types) if t is kind)

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)

    def to_hf_dict(self) -> dict[str, Any]:
        """The equivalent HF ``config.json`` content (model_type ``deepseek_v4``)."""
        d: dict[str, Any] = {
            "model_type": "deepseek_v4",
            "architectures": ["DeepseekV4ForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.rope_head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "index_n_heads": self.index_num_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "sliding_window": self.sliding_window,
            "layer_types": [t.value for t in self.attention_types],
            "mlp_layer_types": [t.value for t in self.mlp_types],
            "compress_rates": {AttentionType.CSA.value: self.csa_ratio, AttentionType.HCA.value: self.hca_ratio},
            "n_routed_experts": self.num_routed_experts,
            "n_shared_experts": self.num_shared_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "routed_scaling_factor": self.routed_scaling_factor,
            "scoring_func": "sqrtsoftplus",
            "norm_topk_prob": True,
            "swiglu_limit": self.swiglu_limit,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "num_nextn_predict_layers": self.num_mtp_layers,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "tie_word_embeddings": False,
        }
        if self.yarn is not None:
            d["rope_scaling"] = {
                "type": "yarn",
                "factor": self.yarn.factor,
                "original_max_position_embeddings": self.yarn.original_max_position_embeddings,
                "beta_fast": self.yarn.beta_fast,
                "beta_slow": self.yarn.beta_slow,
            }
        return d


def _fail(field: str, why: str) -> None:
    raise ConfigError(f"Config.{field}: {why}")


# Upper bounds of every field that scales memory or compute, checked before anything is sized from a config
# (parameters, pools, the loader's name plan): each is 8x or more above DeepSeek-V4-Pro's value (in parentheses),
# so a corrupt or hostile config.json (n_routed_experts 2**31, sliding_window 2**31) fails here naming the field.
# `footprint.check_parameters` then bounds their product, the parameter count. docs/errors.md lists them.
FIELD_CAPS = {
    "vocab_size": 1 << 21,  # (129280)
    "hidden_size": 1 << 16,  # (7168)
    "num_layers": 1024,  # (61)
    "num_heads": 1 << 12,  # (128)
    "head_dim": 1 << 13,  # (512)
    "q_lora_rank": 1 << 16,  # (1536)
    "o_lora_rank": 1 << 16,  # (1024)
    "index_num_heads": 1 << 12,  # (64)
    "index_head_dim": 1 << 13,  # (128)
    "index_topk": 1 << 16,  # (1024)
    "sliding_window": 1 << 16,  # (128): every request holds a ring of this many rows per layer
    "csa_ratio": 1 << 12,  # (4)
    "hca_ratio": 1 << 12,  # (128)
    "num_routed_experts": 1 << 13,  # (384)
    "num_experts_per_tok": 1 << 10,  # (6)
    "moe_intermediate_size": 1 << 17,  # (3072)
    "hc_mult": 64,  # (4)
    "hc_sinkhorn_iters": 1 << 10,  # (20)
    "max_position_embeddings": 1 << 24,  # (1048576)
}
MAX_LAYERS = FIELD_CAPS["num_layers"]


def validate(cfg: Config) -> None:
    positive = (
        "vocab_size hidden_size num_layers num_heads head_dim rope_head_dim q_lora_rank o_groups o_lora_rank "
        "index_num_heads index_head_dim index_topk sliding_window csa_ratio hca_ratio num_routed_experts "
        "num_experts_per_tok moe_intermediate_size hc_mult hc_sinkhorn_iters max_position_embeddings"
    ).split()
    for name in positive:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            _fail(name, f"must be a positive int, got {value!r}")
    for name, cap in FIELD_CAPS.items():
        if getattr(cfg, name) > cap:
            _fail(name, f"must be <= {cap:,} (the bound ds4jax checks before sizing anything), got "
                        f"{getattr(cfg, name):,}")
    if len(cfg.attention_types) != cfg.num_layers:
        _fail("attention_types", f"has {len(cfg.attention_types)} entries, num_layers is {cfg.num_layers}")
    if len(cfg.mlp_types) != cfg.num_layers:
        _fail("mlp_types", f"has {len(cfg.mlp_types)} entries, num_layers is {cfg.num_layers}")
    for name, seq, kind in (("attention_types", cfg.attention_types, AttentionType), ("mlp_types", cfg.mlp_types, MlpType)):
        bad = [t for t in seq if not isinstance(t, kind)]
        if bad:
            _fail(name, f"entries must be {kind.__name__} members, got {bad!r}")
    if cfg.rope_head_dim % 2 or cfg.rope_head_dim > cfg.head_dim:
        _fail("rope_head_dim", f"must be even and <= head_dim ({cfg.head_dim}), got {cfg.rope_head_dim}")
    if cfg.rope_head_dim > cfg.index_head_dim:
        _fail("rope_head_dim", f"must be <= index_head_dim ({cfg.index_head_dim}), got {cfg.rope_head_dim}")
    if cfg.num_heads % cfg.o_groups:
        _fail("o_groups", f"must divide num_heads ({cfg.num_heads}), got {cfg.o_groups}")
    if cfg.num_experts_per_tok > cfg.num_routed_experts:
        _fail("num_experts_per_tok", f"exceeds num_routed_experts ({cfg.num_routed_experts})")
    if cfg.num_shared_experts != 1:
        _fail("num_shared_experts", f"DeepSeek-V4 has exactly one shared expert, got {cfg.num_shared_experts}")
    if cfg.csa_ratio == cfg.hca_ratio:
        _fail("hca_ratio", f"must differ from csa_ratio ({cfg.csa_ratio})")
    for name in ("routed_scaling_factor", "hc_eps", "rms_norm_eps", "swiglu_limit", "rope_theta",
                 "compress_rope_theta"):
        value = getattr(cfg, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
            _fail(name, f"must be a finite number > 0, got {value!r}")
    if cfg.num_mtp_layers not in (0, 1):
        _fail("num_mtp_layers", f"only depth 0 or 1 is defined for DeepSeek-V4, got {cfg.num_mtp_layers}")
    if cfg.yarn is not None and not (0 < cfg.yarn.factor < math.inf and cfg.yarn.original_max_position_embeddings > 0
                                     and math.isfinite(cfg.yarn.beta_fast) and math.isfinite(cfg.yarn.beta_slow)):
        _fail("yarn", f"factor and original_max_position_embeddings must be > 0, got {cfg.yarn!r}")
    if cfg.yarn is not None and cfg.yarn.original_max_position_embeddings > FIELD_CAPS["max_position_embeddings"]:
        _fail("yarn", f"original_max_position_embeddings must be <= {FIELD_CAPS['max_position_embeddings']:,}, "
                      f"got {cfg.yarn.original_max_position_embeddings:,}")
    for name in ("bos_token_id", "eos_token_id"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < cfg.vocab_size:
            _fail(name, f"must be a token id inside the vocabulary [0, {cfg.vocab_size}), got {value!r}")
    if not isinstance(cfg.numerics, Numerics):
        _fail("numerics", f"must be a Numerics member, got {cfg.numerics!r}")
    if cfg.numerics is Numerics.OFFICIAL and cfg.index_head_dim & (cfg.index_head_dim - 1):
        _fail("numerics", f"'official' rotates indexer vectors with a Sylvester Hadamard, which needs a power-of-two "
                          f"index_head_dim, got {cfg.index_head_dim}")
    from ds4jax.model.footprint import check_parameters  # it reads the parameter declaration, which imports us

    check_parameters(cfg)


# ---- presets ------------------------------------------------------------------------------------

def _schedule(n: int, first: tuple[AttentionType, ...]) -> tuple[AttentionType, ...]:
    """`first` then alternating CSA/HCA (CSA on even layer indices), as in the shipped configs."""
    rest = [AttentionType.CSA if i % 2 == 0 else AttentionType.HCA for i in range(len(first), n)]
    return tuple(first[:n]) + tuple(rest)


def _hash_first(n: int, num_hash: int) -> tuple[MlpType, ...]:
    return tuple(MlpType.HASH if i < num_hash else MlpType.TOPK for i in range(n))


def flash() -> Config:
    """DeepSeek-V4-Flash (284B total / 13B active), spec §1."""
    return Config(
        vocab_size=129280, hidden_size=4096, num_layers=43, num_heads=64, head_dim=512, rope_head_dim=64,
        q_lora_rank=1024, o_groups=8, o_lora_rank=1024, index_num_heads=64, index_head_dim=128, index_topk=512,
        sliding_window=128, attention_types=_schedule(43, (AttentionType.SLIDING,) * 2),
        mlp_types=_hash_first(43, 3), num_routed_experts=256, num_experts_per_tok=6, moe_intermediate_size=2048,
        routed_scaling_factor=1.5,
    )


def pro() -> Config:
    """DeepSeek-V4-Pro (1.6T total / 49B active), spec §1."""
    return Config(
        vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128, head_dim=512, rope_head_dim=64,
        q_lora_rank=1536, o_groups=16, o_lora_rank=1024, index_num_heads=64, index_head_dim=128, index_topk=1024,
        sliding_window=128, attention_types=_schedule(61, (AttentionType.HCA,) * 2),
        mlp_types=_hash_first(61, 3), num_routed_experts=384, num_experts_per_tok=6, moe_intermediate_size=3072,
        routed_scaling_factor=2.5,
    )


def flash_slice(num_layers: int) -> Config:
    """Real Flash per-layer dimensions with fewer layers (the first `num_layers` of Flash's schedule)."""
    full = flash()
    if not 1 <= num_layers <= full.num_layers:
        _fail("num_layers", f"flash_slice takes 1..{full.num_layers} layers, got {num_layers}")
    return full.replace(
        num_layers=num_layers,
        attention_types=full.attention_types[:num_layers],
        mlp_types=full.mlp_types[:num_layers],
    )


def tiny(**overrides: Any) -> Config:
    """A small config that exercises every layer type, hash and top-k MoE, the SwiGLU clamp, mHC, YaRN, MTP.

    Three layers, one of each attention kind (sliding / hash MoE, CSA / hash MoE, HCA / top-k MoE): the fewest
    that hold every kind, since every program compiles one body per layer and the tests compile hundreds of them
    (a second CSA / HCA pair added nothing they check; configs that need two layers of a kind say so).
    Ratios and window are shrunk (CSA 4, HCA 8, window 8) so short prompts close many compressor windows and
    wrap the sliding-window ring; 8 indexer heads make exact ties in the indexer's top-k unlikely.
    """
    base = dict(
        vocab_size=256, hidden_size=64, num_layers=3, num_heads=4, head_dim=32, rope_head_dim=16,
        q_lora_rank=32, o_groups=2, o_lora_rank=16, index_num_heads=8, index_head_dim=32, index_topk=4,
        sliding_window=8,
        attention_types=(AttentionType.SLIDING, AttentionType.CSA, AttentionType.HCA),
        mlp_types=_hash_first(3, 2), csa_ratio=4, hca_ratio=8, num_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, routed_scaling_factor=1.5, swiglu_limit=1.0,
        yarn=YarnScaling(factor=16.0, original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0),
        max_position_embeddings=4096,
    )
    base.update(overrides)
    return Config(**base)


PRESETS = {"flash": flash, "pro": pro, "tiny": tiny}


# ---- HF config.json conversion -------------------------------------------------------------------


class _Fields(dict):
    """A config.json object whose typed reads raise `ConfigError` naming the key (JSON has no int/float split,
    so integral floats are ints; booleans and strings are never numbers)."""

    _MISSING = object()

    def int(self, key: str, default: Any = _MISSING) -> int:
        value = self._get(key, default)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError("must be an integer", source="config.json", name=key, value=value)
        return value

    def float(self, key: str, default: Any = _MISSING) -> float:
        value = self._get(key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError("must be a number", source="config.json", name=key, value=value)
        return float(value)

    def first(self, *keys: str) -> str:
        """The first of `keys` present (upstream and HF spell some fields differently), else the first."""
        return next((k for k in keys if k in self), keys[0])

    def _get(self, key: str, default: Any) -> Any:
        value = self.get(key, default)
        if value is self._MISSING:
            raise ConfigError("required field is missing", source="config.json", name=key)
        return value


def from_hf_config(d: Mapping[str, Any]) -> Config:
    """Convert an HF / official ``config.json`` dict (modern or legacy keys) to a `Config`.

    Anything wrong (a missing or mistyped field, an inconsistent value) raises `ConfigError` naming the field."""
    if not isinstance(d, Mapping):
        raise ConfigError("must be a JSON object", source="config.json", value=type(d).__name__)
    try:
        return _from_hf_config(_Fields(d))
    except ConfigError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError) as e:  # nested odd shapes
        raise ConfigError(f"malformed value ({type(e).__name__}: {e})", source="config.json") from None


def _from_hf_config(d: _Fields) -> Config:
    model_type = d.get("model_type", "deepseek_v4")
    if model_type != "deepseek_v4":
        raise ConfigError(f"Config.model_type: expected 'deepseek_v4', got {model_type!r}")
    num_layers = d.int(d.first("num_hidden_layers", "n_layers"))
    if not 0 < num_layers <= MAX_LAYERS:  # bounds the per-layer tuples built below
        _fail("num_layers", f"must be in [1, {MAX_LAYERS}], got {num_layers}")
    rates = _Fields(d.get("compress_rates") or {})
    csa_ratio = d.int("compress_rate_csa", rates.int(AttentionType.CSA.value, 4))
    hca_ratio = d.int("compress_rate_hca", rates.int(AttentionType.HCA.value, 128))
    if d.get("layer_types") is not None:
        try:
            attention = tuple(AttentionType(t) for t in d["layer_types"])
        except ValueError as e:
            raise ConfigError(f"Config.attention_types: {e}") from None
    elif d.get("compress_ratios") is not None:
        by_ratio = {0: AttentionType.SLIDING, csa_ratio: AttentionType.CSA, hca_ratio: AttentionType.HCA}
        ratios = list(d["compress_ratios"])[:num_layers]  # trailing entry is the MTP layer
        bad = [r for r in ratios if r not in by_ratio]
        if bad:
            _fail("attention_types", f"compress_ratios has unknown ratios {bad}")
        attention = tuple(by_ratio[r] for r in ratios)
    else:
        _fail("attention_types", "config.json must carry layer_types or compress_ratios (HF's default is wrong)")
    if d.get("mlp_layer_types") is not None:
        try:
            mlp = tuple(MlpType(t) for t in d["mlp_layer_types"])
        except ValueError as e:
            raise ConfigError(f"Config.mlp_types: {e}") from None
    else:
        mlp = _hash_first(num_layers, d.int("num_hash_layers", 3))
    head_dim = d.int("head_dim", 512)
    if "qk_rope_head_dim" in d:
        rope_head_dim = d.int("qk_rope_head_dim")
    else:
        factor = d.get("partial_rotary_factor")
        rope_params = d.get("rope_parameters") or {}
        if factor is None and isinstance(rope_params.get("main"), dict):
            factor = rope_params["main"].get("partial_rotary_factor")
        factor = _Fields(partial_rotary_factor=0.125 if factor is None else factor).float("partial_rotary_factor")
        rope_head_dim = int(round(head_dim * factor)) if math.isfinite(factor) else -1
    yarn = _yarn_from(d)
    rope_theta = d.get("rope_theta")
    compress_theta = d.get("compress_rope_theta")
    rope_params = d.get("rope_parameters") or {}
    if rope_theta is None and isinstance(rope_params.get("main"), dict):
        rope_theta = rope_params["main"].get("rope_theta")
    if compress_theta is None and isinstance(rope_params.get("compress"), dict):
        compress_theta = rope_params["compress"].get("rope_theta")
    eos = d.get("eos_token_id", 1)
    if isinstance(eos, (list, tuple)):  # HF allows several; the first one stops generation
        eos = eos[0] if eos else None
    if d.get("num_key_value_heads", 1) != 1:
        _fail("num_key_value_heads", f"DeepSeek-V4 has one shared K=V head, got {d.get('num_key_value_heads')}")
    if d.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
        _fail("scoring_func", f"only sqrtsoftplus is supported, got {d.get('scoring_func')!r}")
    return Config(
        vocab_size=d.int("vocab_size"),
        hidden_size=d.int(d.first("hidden_size", "dim")),
        num_layers=num_layers,
        num_heads=d.int(d.first("num_attention_heads", "n_heads")),
        head_dim=head_dim,
        rope_head_dim=rope_head_dim,
        q_lora_rank=d.int("q_lora_rank"),
        o_groups=d.int("o_groups"),
        o_lora_rank=d.int("o_lora_rank"),
        index_num_heads=d.int("index_n_heads"),
        index_head_dim=d.int("index_head_dim"),
        index_topk=d.int("index_topk"),
        sliding_window=d.int(d.first("sliding_window", "window_size"), 128),
        attention_types=attention,
        mlp_types=mlp,
        csa_ratio=csa_ratio,
        hca_ratio=hca_ratio,
        num_routed_experts=d.int("n_routed_experts"),
        num_shared_experts=d.int("n_shared_experts", 1),
        num_experts_per_tok=d.int("num_experts_per_tok"),
        moe_intermediate_size=d.int("moe_intermediate_size"),
        routed_scaling_factor=d.float("routed_scaling_factor", 1.5),
        swiglu_limit=d.float("swiglu_limit", 10.0),
        hc_mult=d.int("hc_mult", 4),
        hc_sinkhorn_iters=d.int("hc_sinkhorn_iters", 20),
        hc_eps=d.float("hc_eps", 1e-6),
        rms_norm_eps=d.float("rms_norm_eps", 1e-6),
        rope_theta=_Fields(rope_theta=rope_theta or 10000.0).float("rope_theta"),
        compress_rope_theta=_Fields(compress_rope_theta=compress_theta or 160000.0).float("compress_rope_theta"),
        yarn=yarn,
        max_position_embeddings=d.int("max_position_embeddings", 1048576),
        num_mtp_layers=d.int("num_nextn_predict_layers", 1),
        bos_token_id=_Fields(bos_token_id=d.get("bos_token_id") or 0).int("bos_token_id"),
        eos_token_id=_Fields(eos_token_id=1 if eos is None else eos).int("eos_token_id"),
    )


def _yarn_from(d: Mapping[str, Any]) -> YarnScaling | None:
    scaling = d.get("rope_scaling")
    if scaling is None:
        params = d.get("rope_parameters") or {}
        if isinstance(params.get("compress"), dict):
            scaling = params["compress"]
        elif params.get("rope_type", params.get("type")) == "yarn":
            scaling = params
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "yarn":
        _fail("yarn", f"only yarn rope scaling is supported, got {kind!r}")
    scaling = _Fields(scaling)
    return YarnScaling(
        factor=scaling.float("factor"),
        original_max_position_embeddings=scaling.int("original_max_position_embeddings"),
        beta_fast=scaling.float("beta_fast", 32.0),
        beta_slow=scaling.float("beta_slow", 1.0),
    )


def load_config(path: str | os.PathLike) -> Config:
    """Read ``config.json`` from a checkpoint directory (or the file itself); `ConfigError` names the file and the
    field (or the JSON line and column) at fault."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    d = read_json(path, ConfigError)
    try:
        return from_hf_config(d)
    except ConfigError as e:
        if e.source in (None, "config.json"):
            raise ConfigError(e.message, source=path, name=e.name, value=e.value) from None
        raise


def read_json(path: str, error: type[Exception]) -> Any:
    """A JSON file's content; a missing, unreadable, non-regular, oversized, non-UTF-8 or malformed file raises
    `error` naming it."""
    data = read_bytes(path, error)  # a regular file under a size cap (a link to /dev/zero is refused)
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise error(f"is not UTF-8 (byte {e.start})", source=path) from None
    except json.JSONDecodeError as e:
        raise error(f"is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}", source=path) from None
    except RecursionError:
        raise error("is not valid JSON: nested too deeply", source=path) from None

