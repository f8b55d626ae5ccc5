"""What a config costs, from its parameter declaration alone (shapes, nothing allocated): parameter counts by
part, weight bytes in a compute dtype, and the bound on the total that every `Config` must stay under.

The per-field caps (`config.FIELD_CAPS`) bound each dimension; their product can still be absurd (8192 experts
of width 2**17 in 1024 layers), so `check_parameters` bounds the total and names the fields of the part that
dominates it. `ds4jax info` prints these counts; the loader compares `weight_bytes` with the device's memory
(`ds4jax.runtime.memory`) before it reads a tensor.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

MAX_PARAMETERS = 1 << 43  # 8.8 trillion: 5.5x DeepSeek-V4-Pro's 1.6T

# the config fields each part of the parameter tree scales with, largest factors first (for error messages)
PART_FIELDS = {
    "routed experts": "num_routed_experts x moe_intermediate_size x hidden_size x num_layers",
    "embedding and head": "vocab_size x hidden_size",
    "hash routing tables": "vocab_size x num_experts_per_tok x hash layers",
    "attention": "num_heads x head_dim x q_lora_rank / o_lora_rank x num_layers",
    "indexer": "index_num_heads x index_head_dim x q_lora_rank x CSA layers",
    "compressors": "csa_ratio / hca_ratio x head_dim x hidden_size x compressed layers",
    "shared experts": "moe_intermediate_size x hidden_size x num_layers",
    "mHC": "hc_mult x hidden_size x num_layers",
    "other": "hidden_size x num_layers",
}


def _part(path: tuple[str, ...]) -> str:
    if path[0] in ("embed", "head"):
        return "embedding and head"
    if "experts" in path:
        return "routed experts"
    if "tid2eid" in path:
        return "hash routing tables"
    if "indexer" in path:
        return "indexer"
    if "compressor" in path:
        return "compressors"
    if "shared" in path:
        return "shared experts"
    if any(p.startswith("hc_") for p in path):
        return "mHC"
    if "attn" in path:
        return "attention"
    return "other"


def _leaves(cfg) -> list[tuple[tuple[str, ...], Any]]:
    import jax

    from ds4jax.model.params import _is_info, declare

    flat = jax.tree_util.tree_flatten_with_path(declare(cfg), is_leaf=_is_info)[0]
    return [(tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path), info) for path, info in flat]


def parameter_counts(cfg) -> dict[str, int]:
    """Parameters of each part (`PART_FIELDS`), the MTP block included, from the declaration (Python ints)."""
    return dict(_counts(cfg))


@functools.lru_cache(maxsize=256)  # every Config validates through here; derived configs (mesh slices) repeat
def _counts(cfg) -> tuple[tuple[str, int], ...]:
    counts = dict.fromkeys(PART_FIELDS, 0)
    for path, info in _leaves(cfg):
        counts[_part(path)] += math.prod(info.shape)
    return tuple(counts.items())


def weight_bytes(cfg, dtype: Any) -> int:
    """Bytes of the weights in compute dtype `dtype` (norms, mHC, sinks and router biases float32, tid2eid int32)."""
    return sum(math.prod(info.shape) * np.dtype(info.dtype(dtype)).itemsize for _, info in _leaves(cfg))


def check_parameters(cfg) -> None:
    """`ConfigError` when the config declares more than `MAX_PARAMETERS` parameters, naming the dominant part."""
    from ds4jax.errors import ConfigError

    counts = parameter_counts(cfg)
    total = sum(counts.values())
    if total > MAX_PARAMETERS:
        part = max(counts, key=counts.get)
        raise ConfigError(f"declares {total:,} parameters, more than the {MAX_PARAMETERS:,} ds4jax accepts; most are "
                          f"{part} ({counts[part]:,}: {PART_FIELDS[part]})", source="Config")


def weights(cfg, dtype: Any) -> tuple[int, str]:
    """(bytes, what) of the weights in `dtype`, for `ds4jax.runtime.memory.check_fits` before a load."""
    counts = parameter_counts(cfg)
    part = max(counts, key=counts.get)
    return weight_bytes(cfg, dtype), (f"the weights ({sum(counts.values()):,} parameters in {np.dtype(dtype).name}; "
                                      f"most are {part}: {PART_FIELDS[part]})")


def step_bytes(cfg, tokens: int, dtype: Any) -> int:
    """A lower bound on the working memory of one step over `tokens` tokens in activation dtype `dtype`: the mHC
    streams in and out, plus the larger of one layer's attention queries and outputs and its routed experts'
    hidden activations (what any implementation holds at once; attention scores, which kernels may never write,
    are not counted)."""
    b = np.dtype(dtype).itemsize
    streams = 2 * tokens * cfg.hc_mult * cfg.hidden_size * b
    attention = 2 * tokens * cfg.num_heads * cfg.head_dim * b
    experts = 2 * tokens * cfg.num_experts_per_tok * cfg.moe_intermediate_size * b
    return streams + max(attention, experts)


STEP_FIELDS = "hc_mult x hidden_size, num_heads x head_dim, num_experts_per_tok x moe_intermediate_size"
