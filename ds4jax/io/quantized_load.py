"""Keeping a checkpoint's FP8 / FP4 weights as stored (`ds4jax.load(..., weights="checkpoint")`).

A params leaf becomes a `ds4jax.model.quantized.QuantizedWeight` straight from the checkpoint bytes when all of
its sources are quantized the same way and the layout keeps the blocks whole: a transposed linear (``[out, in]``
-> ``[in, out]``: bytes and scale grid transpose) or a routed-expert stack (one such per expert). The bytes are
never dequantized on the host; only the transposes and the stacking copy them. Anything else quantized
(``wo_a``, which DeepSeek's own inference also dequantizes; HF's fused gate_up rows; FP4 with float scales) is
dequantized into the compute dtype as in the ``"bf16"`` mode.

FP8 bytes go to the device in its FP8 variant (`Target.fp8_dtype`): on MI300 the OCP bytes are converted to FNUZ
exactly (`quant_formats.ocp_to_fnuz`: the scales double). FP8 scales are float32 (one per block, negligible
bytes); FP4 scales stay E8M0 bytes, which the kernels decode.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.errors import CheckpointError
from ds4jax.io import stored_footprint
from ds4jax.io.quant_formats import ocp_to_fnuz
from ds4jax.io.safetensors_layout import (EXPERTS, FP4_WEIGHT, FP8_WEIGHT, T, Leaf, Loc, checked_scales,
                                          read_scale, read_tensor)
from ds4jax.model.quantized import FP4_BLOCK, Format, QuantizedWeight

_E8M0 = ("F8_E8M0", "U8")


def quantized_format(leaf: Leaf, locs: dict[str, Loc]) -> Format | None:
    """The format `leaf` can be kept in as stored, or None (unquantized, or a layout that needs dequantizing)."""
    if leaf.layout not in (T, EXPERTS):
        return None
    formats = set()
    for name in leaf.sources:
        loc = locs[name]
        if loc.scale is None or loc.rows is not None:
            return None
        dtype, _ = loc.shard.info(loc.key)
        if dtype == FP8_WEIGHT:
            formats.add(Format.FP8)
        elif dtype in FP4_WEIGHT and loc.scale[0].info(loc.scale[1])[0] in _E8M0:
            formats.add(Format.FP4)
        else:
            return None
    return formats.pop() if len(formats) == 1 else None


def kept_bytes(leaves: list[Leaf], locs: dict[str, Loc]) -> tuple[int, str]:
    """(bytes, what) of the weights loaded in the checkpoint's formats, for `memory.check_fits` before a load: FP8
    and FP4 leaves as `QuantizedWeight`s (values + scales, `stored_footprint`), the rest in its declared dtype.
    Without it a checkpoint too large for the device failed partway through the load, in an allocation."""
    total, quantized = 0, 0
    for leaf in leaves:
        shape = tuple(leaf.target.shape)
        fmt = quantized_format(leaf, locs)
        if fmt is None:
            total += math.prod(shape) * np.dtype(leaf.target.dtype).itemsize
        else:
            quantized += 1
            total += stored_footprint.quantized_bytes(shape, "fp8" if fmt is Format.FP8 else "fp4")
    return total, (f"the weights in the checkpoint's formats ({quantized} of {len(leaves)} tensors kept FP8 / FP4; "
                   "weights='bf16' dequantizes them, larger)")


def _fp8_source(loc: Loc, fp8_dtype, dtype, check_finite: bool) -> tuple[np.ndarray, np.ndarray]:
    raw = read_tensor(loc.shard, loc.key, loc.expert).view(np.uint8)  # [out, in]
    if check_finite:
        bad = (raw & 0x7F) == 0x7F  # E4M3 NaN
        if bad.any():
            index = [int(i) for i in np.argwhere(bad)[0]]
            raise CheckpointError(f"non-finite value nan at index {index}", source=loc.shard.path, name=loc.key)
    scale = read_scale(*loc.scale, loc.expert, FP8_WEIGHT, dtype)  # float32 [ceil(out/bo), ceil(in/bi)]
    if np.dtype(fp8_dtype) == np.dtype(jnp.float8_e4m3fnuz):
        raw, scale = ocp_to_fnuz(raw, scale)
    return raw.T, scale.T


def _fp4_source(loc: Loc, dtype) -> tuple[np.ndarray, np.ndarray]:
    packed = read_tensor(loc.shard, loc.key, loc.expert).view(np.uint8)  # [out, in/2]
    scale_shard, scale_key = loc.scale
    scale = read_tensor(scale_shard, scale_key, loc.expert).view(np.uint8)  # E8M0 [out, in/32], kept as bytes
    checked_scales(scale, scale_shard, scale_key, loc.shard.info(loc.key)[0], dtype)
    return packed.T, scale.T


def load_quantized(leaf: Leaf, locs: dict[str, Loc], fmt: Format, block: tuple[int, int], fp8_dtype,
                   check_finite: bool = False) -> QuantizedWeight:
    """The leaf as a `QuantizedWeight` (device arrays); `block` is the checkpoint's FP8 block over [out, in]."""
    dtype = leaf.target.dtype  # the compute dtype the kernels dequantize into
    parts = [_fp8_source(locs[n], fp8_dtype, dtype, check_finite) if fmt is Format.FP8 else _fp4_source(locs[n], dtype)
             for n in leaf.sources]
    if leaf.layout == EXPERTS:
        values, scales = np.stack([v for v, _ in parts]), np.stack([s for _, s in parts])
    else:
        (values, scales), = parts
    values, scales = np.ascontiguousarray(values), np.ascontiguousarray(scales)
    put = jax.device_put  # a transfer; `jnp.asarray` would compile an identity program per shape (checkpoint.py)
    if fmt is Format.FP8:
        return QuantizedWeight(put(values.view(fp8_dtype)), put(scales), fmt, (block[1], block[0]))
    return QuantizedWeight(put(values), put(scales), fmt, FP4_BLOCK)
