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
