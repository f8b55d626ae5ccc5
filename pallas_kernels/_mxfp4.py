"""MXFP4 decoding in jnp, usable inside kernels (Triton, interpreter) and in plain XLA code alike.

FP4 E2M1 codes (4 bits: sign, 2 exponent bits, 1 mantissa bit; values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
negatives) are decoded with integer arithmetic, no table lookup (a kernel has no gather from constants), and E8M0
scale bytes b by building the float32 bit pattern b << 23 = 2^(b - 127). No FP4 hardware is assumed (MI300 has
none): everything runs in the registers as int32 / float32 ops.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

E8M0_ZERO = 2.0**-127  # byte 0: a subnormal float32, not representable as an exponent field


def e2m1_to_float(codes):
    """int32 codes in [0, 16) -> float32 values (code 8 is -0.0)."""
    e = (codes >> 1) & 3
    m = (codes & 1).astype(jnp.float32)
    normal = (m + 2.0) * lax.shift_left(jnp.ones_like(e), e).astype(jnp.float32) * 0.25  # (1 + m/2) * 2^(e-1)
    magnitude = jnp.where(e == 0, m * 0.5, normal)
    return jnp.where((codes & 8) != 0, -magnitude, magnitude)


def e8m0_to_float(b):
    """E8M0 bytes (uint8 or int32 in [0, 255)) -> float32 2^(b - 127); byte 255 (NaN) is refused at load."""
    b = b.astype(jnp.int32)
    return jnp.where(b == 0, jnp.float32(E8M0_ZERO), lax.bitcast_convert_type(b << 23, jnp.float32))


def unpack_fp4(packed):
    """uint8 [..., j, n] -> (even, odd) int32 codes [..., j, n]: inputs 2j (low nibble) and 2j + 1 (high)."""
    u = packed.astype(jnp.int32)
    return u & 15, (u >> 4) & 15


def dequantize_fp4(packed, scales, dtype=jnp.float32):
    """Packed [..., k/2, n] uint8 + E8M0 scales [..., k/32, n] -> [..., k, n] in `dtype` (packed along k: row j
    holds inputs 2j and 2j + 1; one scale per 32 inputs of a column)."""
    even, odd = unpack_fp4(packed)
    values = jnp.stack([e2m1_to_float(even), e2m1_to_float(odd)], axis=-2)  # [..., k/2, 2, n]
    values = values.reshape(*packed.shape[:-2], 2 * packed.shape[-2], packed.shape[-1])
    scale = jnp.repeat(e8m0_to_float(scales), 32, axis=-2)
    return (values * scale).astype(dtype)
