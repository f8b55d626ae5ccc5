"""What the weights of a config take on the device when loaded from a quantized checkpoint as they are stored
(``ds4jax.load(..., weights="checkpoint")``), from the config alone: nothing is read or allocated.

A checkpoint quantized as ``"fp4"`` (DeepSeek-V4 as published) holds the dense linears of
`official_format.FP8_LINEARS` in FP8 and the routed experts in FP4; ``"fp8"`` holds both in FP8. Everything else
(embedding, head, norms, mHC, routers, ``wo_a``...) loads in the compute dtype's declared dtype, as in the
unquantized case. On the device (`ds4jax.model.quantized.QuantizedWeight`):

* FP8: one byte per weight, plus a float32 scale per 128 x 128 block;
* FP4: half a byte per weight, plus one E8M0 byte per 32 inputs.

`leaf_bytes` is per params leaf, in the flatten order of `ds4jax.model.params.abstract`, so a mesh's memory
report can scale each leaf's shard by it (`MeshLayout.memory_report(..., quantized=...)`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

FP8_BLOCK = (128, 128)  # the published block of the dense FP8 weights (params layout [in, out]: square anyway)
FP4_GROUP = 32  # inputs per E8M0 scale


def quantized_bytes(shape: tuple[int, ...], fmt: str) -> int:
    """Device bytes of a `QuantizedWeight` of `shape` ([..., in, out]) in `fmt` ("fp8", "fp4")."""
    *lead, rows, cols = shape
    n = math.prod(lead)
    if fmt == "fp4":
        return n * (rows * cols // 2 + (rows // FP4_GROUP) * cols)
    blocks = -(-rows // FP8_BLOCK[0]) * -(-cols // FP8_BLOCK[1])
    return n * (rows * cols + 4 * blocks)


def leaf_formats(cfg, dtype: Any, quantized: str | None) -> list[tuple[Any, str | None]]:
    """(`safetensors_layout.Leaf`, "fp8" / "fp4" / None) for every params leaf in `params.abstract(cfg, dtype)`'s
    flatten order: how a checkpoint quantized as `quantized` stores it (None: unquantized). The one place that
    choice is made from a config (`quantize.quantize_model` quantizes by it)."""
    from ds4jax.io import official_format
    from ds4jax.io.safetensors_layout import EXPERTS, T, plan

    official_format.check_quantize(quantized)
    return [(leaf, official_format.weight_format(leaf.sources[0], quantized) if leaf.layout in (T, EXPERTS) else None)
            for leaf in plan(cfg, dtype)]


def leaf_bytes(cfg, dtype: Any, quantized: str | None) -> list[int]:
    """Device bytes of every params leaf, in `params.abstract(cfg, dtype)`'s flatten order, for a checkpoint
    quantized as `quantized` ("fp8", "fp4"; None: every leaf in its declared dtype for `dtype`)."""
    out = []
    for leaf, fmt in leaf_formats(cfg, dtype, quantized):
        shape, itemsize = tuple(leaf.target.shape), np.dtype(leaf.target.dtype).itemsize
        out.append(math.prod(shape) * itemsize if fmt is None else quantized_bytes(shape, fmt))
    return out


def weight_bytes(cfg, dtype: Any, quantized: str | None) -> int:
    """All of `leaf_bytes` (the MTP block included)."""
    return sum(leaf_bytes(cfg, dtype, quantized))
