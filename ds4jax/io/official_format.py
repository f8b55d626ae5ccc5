"""The published DeepSeek-V4 tensor formats, writer side (spec §5.1-§5.2): which tensor is stored how.

Instruct checkpoints (``quantize="fp4"``): FP8 E4M3 + E8M0 block scales for the dense linears listed in spec
§5.2, FP4 E2M1 (two per byte, I8) + one E8M0 scale per 32 inputs for the routed experts. Base checkpoints
(``quantize="fp8"``): the routed experts FP8 too. Everything else as published: F32 for mHC, sinks, ape, router
bias; I64 tid2eid; BF16 for the rest (norms, embed, head, router, compressors). ``config.json`` takes the
upstream keys (``compress_ratios`` with the MTP layer's entry appended, ``num_hash_layers``,
``quantization_config``, ``expert_dtype``).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ds4jax.errors import ArgumentError
from ds4jax.io.quant_formats import quantize_fp4, quantize_fp8
from ds4jax.model.config import AttentionType, Config, MlpType

QUANTIZE = ("fp8", "fp4")
# spec §5.2: the FP8 linears of a published checkpoint (compressor, indexer weights_proj, router stay BF16)
FP8_LINEARS = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b",
               "ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3", "e_proj", "h_proj")
F32_NAMES = ("hc_", "attn_sink", ".ape", "gate.bias")  # stored F32 upstream


def check_quantize(quantize: str | None) -> None:
    if quantize is not None and quantize not in QUANTIZE:
        raise ArgumentError(f"must be one of {QUANTIZE} or None", name="quantize", value=quantize)


def weight_format(name: str, quantize: str | None) -> str | None:
    """"fp8" / "fp4" / None (unquantized) for upstream tensor `name` in a checkpoint quantized as `quantize`."""
    if quantize is None or not name.endswith(".weight"):
        return None
    base = name[: -len(".weight")]
    if ".ffn.experts." in name:
        return quantize
    return "fp8" if base.endswith(FP8_LINEARS) else None


def encode(name: str, a: np.ndarray, quantize: str | None, block: tuple[int, int]) -> dict[str, np.ndarray]:
    """One tensor in checkpoint orientation -> the tensors to write for it (weight, and scale if quantized)."""
    fmt = weight_format(name, quantize)
    if fmt is None:
        if quantize is None or np.issubdtype(a.dtype, np.integer):
            return {name: a}
        keep = any(k in name for k in F32_NAMES)
        return {name: np.ascontiguousarray(a.astype(np.float32 if keep else ml_dtypes.bfloat16))}
    base = name[: -len(".weight")]
    a = np.asarray(a, np.float32)
    bad = ~np.isfinite(a)
    if bad.any():  # its block's scale would be 2^127 (E8M0's largest), the value NaN and the rest of the block 0
        index = [int(i) for i in np.argwhere(bad)[0]]
        raise ArgumentError(f"holds {a[tuple(index)]} at index {index}: {fmt.upper()} cannot encode a non-finite "
                            "value", name=name)
    if fmt == "fp8":
        q, s = quantize_fp8(a, block)
        q = q.view(ml_dtypes.float8_e4m3fn)
    else:
        q, s = quantize_fp4(a)
        q = q.view(np.int8)  # published as I8
    return {name: q, base + ".scale": s.view(ml_dtypes.float8_e8m0fnu)}


def nbytes(name: str, shape: tuple[int, ...], dtype: np.dtype, quantize: str | None) -> int:
    """Bytes `encode` writes for a tensor (weight and scales), for cutting shards before encoding."""
    n = int(np.prod(shape))
    fmt = weight_format(name, quantize)
    if fmt == "fp8":
        return n + n // (128 * 128) + 1
    if fmt == "fp4":
        return n // 2 + n // 32
    if np.issubdtype(dtype, np.integer):
        return 8 * n  # tid2eid is written as I64
    if quantize is None:
        return np.dtype(dtype).itemsize * n
    return (4 if any(k in name for k in F32_NAMES) else 2) * n


def official_config(cfg: Config, quantize: str | None, block: tuple[int, int]) -> dict:
    """``config.json`` with the upstream layer keys and, when quantized, the published quantization_config."""
    d = cfg.to_hf_dict()
    if quantize is None:
        return d
    ratio = {AttentionType.SLIDING: 0, AttentionType.CSA: cfg.csa_ratio, AttentionType.HCA: cfg.hca_ratio}
    d["compress_ratios"] = [ratio[t] for t in cfg.attention_types] + [0] * cfg.num_mtp_layers
    d["compress_rate_csa"], d["compress_rate_hca"] = cfg.csa_ratio, cfg.hca_ratio
    hash_layers = sum(t is MlpType.HASH for t in cfg.mlp_types)
    if all(t is MlpType.HASH for t in cfg.mlp_types[:hash_layers]):  # hash-first: upstream's num_hash_layers
        d["num_hash_layers"] = hash_layers
        del d["mlp_layer_types"]
    del d["layer_types"], d["compress_rates"]
    d["expert_dtype"] = quantize
    d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "scale_fmt": "ue8m0", "weight_block_size": list(block)}
    return d
