"""Checkpoint number formats (spec §5.2): E8M0 scales, FP8 E4M3 with block scales, FP4 E2M1 packed two per byte.

Host-side (numpy) conversions between these formats and float32; `ml_dtypes` supplies the float8 types.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

FP4_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
FP4_BLOCK = 32  # MXFP4: one E8M0 scale per 32 consecutive input elements of a row


def e8m0_to_float(raw: np.ndarray) -> np.ndarray:
    """E8M0 scale bytes b -> 2**(b - 127) in float32 (b = 255 is NaN)."""
    b = np.asarray(raw).view(np.uint8).astype(np.int32)
    out = np.ldexp(np.float32(1), np.minimum(b, 254) - 127).astype(np.float32)
    out[b == 255] = np.nan
    return out


def dequant_fp8(raw: np.ndarray, scale: np.ndarray, block: tuple[int, int] = (128, 128)) -> np.ndarray:
    """FP8 block dequant: E4M3 bytes [..., r, c], float scale [..., ceil(r/br), ceil(c/bc)] -> float32 [..., r, c]."""
    r, c = raw.shape[-2:]
    w = np.asarray(raw).view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    s = np.repeat(np.repeat(scale.astype(np.float32), block[0], axis=-2), block[1], axis=-1)[..., :r, :c]
    return w * s


def dequant_fp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """FP4 (e2m1) dequant: bytes [..., r, c/2] (low nibble first), scale [..., r, c/32] -> float32 [..., r, c]."""
    u = np.asarray(packed).view(np.uint8)
    values = np.stack([FP4_VALUES[u & 0xF], FP4_VALUES[u >> 4]], axis=-1).reshape(*u.shape[:-1], 2 * u.shape[-1])
    return values * np.repeat(scale.astype(np.float32), FP4_BLOCK, axis=-1)


# ---- quantization (what the published checkpoints hold; `ds4jax convert --quantize`) ---------------------------

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest e2m1 value


def _scale_exponents(amax: np.ndarray, top: float) -> np.ndarray:
    """Smallest power-of-two exponent e with amax / 2**e <= top (0 for an all-zero block), clipped to E8M0's
    range."""
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(np.asarray(amax, np.float64) / top))
    return np.clip(np.where(amax > 0, e, 0), -127, 127).astype(np.int32)


def float_to_e8m0(exponents: np.ndarray) -> np.ndarray:
    """Integer exponents e -> E8M0 bytes e + 127 (uint8)."""
    return (np.asarray(exponents, np.int32) + 127).astype(np.uint8)


def quantize_fp8(w: np.ndarray, block: tuple[int, int] = (128, 128)) -> tuple[np.ndarray, np.ndarray]:
    """float [r, c] -> (float8_e4m3fn bytes as uint8 [r, c], E8M0 scale bytes [ceil(r/br), ceil(c/bc)]).

    One power-of-two scale per block maps the block's largest magnitude to at most 448; values then round to
    nearest e4m3 (ml_dtypes' cast: round half to even)."""
    w = np.asarray(w, np.float32)
    r, c = w.shape
    br, bc = block
    R, C = -(-r // br), -(-c // bc)
    padded = np.zeros((R * br, C * bc), np.float32)
    padded[:r, :c] = np.abs(w)
    exps = _scale_exponents(padded.reshape(R, br, C, bc).max(axis=(1, 3)), FP8_MAX)
    full = np.repeat(np.repeat(exps, br, 0), bc, 1)[:r, :c]
    q = np.ldexp(w, -full).astype(ml_dtypes.float8_e4m3fn)
    return q.view(np.uint8), float_to_e8m0(exps)


def quantize_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [r, c] (c % 32 == 0) -> (packed e2m1 bytes [r, c/2], low nibble = even column; E8M0 scales [r, c/32]).

    One power-of-two scale per 32 inputs of a row maps the group's largest magnitude to at most 6; values round to
    nearest e2m1 (ml_dtypes' float4_e2m1fn cast, whose 4-bit codes are the `FP4_VALUES` indices)."""
    w = np.asarray(w, np.float32)
    r, c = w.shape
    if c % FP4_BLOCK:
        raise ValueError(f"FP4 needs an input dim divisible by {FP4_BLOCK}, got {c}")
    groups = w.reshape(r, c // FP4_BLOCK, FP4_BLOCK)
    exps = _scale_exponents(np.abs(groups).max(-1), FP4_MAX)
    codes = np.ldexp(groups, -exps[..., None]).astype(ml_dtypes.float4_e2m1fn).view(np.uint8).reshape(r, c) & 0xF
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8), float_to_e8m0(exps)


# ---- FNUZ (MI300) ----------------------------------------------------------------------------------------------

_OCP_NEG_ZERO, _OCP_NAN, _FNUZ_NAN = 0x80, 0x7F, 0x80


def ocp_to_fnuz(raw: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float8_e4m3fn bytes + float scales -> float8_e4m3fnuz bytes + scales, the same values exactly.

    FNUZ's exponent bias is 8, OCP's 7: the same bits mean half the value (reading OCP bytes as FNUZ is off by a
    factor of 2), so the bytes stay and the scales double. Except: OCP -0 (0x80) is FNUZ's NaN, so it becomes
    +0, and OCP NaN (0x7F / 0xFF, the bytes FNUZ reads as +-240) becomes FNUZ NaN."""
    b = np.asarray(raw).view(np.uint8)
    nan = (b & 0x7F) == _OCP_NAN
    out = np.where(b == _OCP_NEG_ZERO, np.uint8(0), b)
    out = np.where(nan, np.uint8(_FNUZ_NAN), out).astype(np.uint8)
    return out, np.asarray(scale, np.float32) * 2
