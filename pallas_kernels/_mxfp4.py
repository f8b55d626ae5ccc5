"""MXFP4 decoding in jnp, usable inside kernels (Triton, interpreter) and in plain XLA code alike.

FP4 E2M1 codes (4 bits: sign, 2 exponent bits, 1 mantissa bit; values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
negatives) are decoded with integer arithmetic, no table lookup (a kernel has no gather from constants), and E8M0
scale bytes b by building the float32 bit pattern b << 23 = 2^(b - 127). No FP4 hardware is assumed (MI300 has
none): everything runs in the registers as int32 / float32 ops.

Two decoders of a code times its scale: `e2m1_to_float(c) * scale` (the specification: value arithmetic, with two
int -> float conversions per value) and `fp4_times_scale` (the kernels': the magnitude's float bits built with a
shift and an add, one min for the two small codes, one multiply by the scale, the sign OR-ed in; no conversion),
bitwise equal for every code and scale byte (`tests/kernels/test_mxfp4_decode.py`).

A third, `fp4_as_e4m3`, hands the work to the device's FP8 conversion where it has one (sm89+, MI355): each code's
bits are moved into an OCP E4M3 byte (two masks and shifts per code), which reads exactly 2^-6 times the E2M1 value
(both formats have subnormals, so the two codes with exponent 0 land right too), and the conversion to float32 is
the hardware's (on sm90 one instruction per pair). MI300 converts only FNUZ E4M3, which Pallas' Triton lowering
does not, so it keeps the integer decode.
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


E2M1_BIAS_BITS = 126 << 23  # float32 bits of 0.5: magnitude code c (e = c >> 1, m = c & 1) at bits 22..24 lands
# as exponent field 126 + e and top mantissa bit m: 2^(e - 1) (1 + m/2), the E2M1 value of every normal code


def fp4_times_scale(codes, scale):
    """int32 codes in [0, 16) times float32 `scale` (broadcast) -> float32, bitwise equal to
    `e2m1_to_float(codes) * scale` on the same platform (the same float multiply: a scale byte 0's subnormal 2^-127
    and subnormal products behave as there, flushed or not; overflow gives inf as there).

    The magnitude c & 7 is placed into the float bits as 2^(e - 1) (1 + m/2) (exact for e > 0); the two codes with
    e = 0 come out 0.5 and 0.75 instead of 0 and 0.5, which is 2v - 1: min(v, 2v - 1) picks that for v < 1 and v
    itself otherwise (both exact). The sign goes on last, by OR: the product is >= +0 before, so code 8 gives -0.0
    and a flushed negative product -0.0, as the reference's signed multiply does."""
    v = lax.bitcast_convert_type(((codes & 7) << 22) + E2M1_BIAS_BITS, jnp.float32)
    magnitude = jnp.minimum(v, v * 2.0 - 1.0)
    bits = lax.bitcast_convert_type(magnitude * scale, jnp.int32) | ((codes & 8) << 28)
    return lax.bitcast_convert_type(bits, jnp.float32)


E4M3_PER_E2M1 = 2.0**-6  # what an E2M1 code reads as once its bits sit in an OCP E4M3 byte (`fp4_as_e4m3`)


def fp4_as_e4m3(packed):
    """uint8 packed codes -> (low nibbles, high nibbles) as float8_e4m3fn, each exactly `E4M3_PER_E2M1` times the
    code's E2M1 value: the magnitude bits (e1 e0 m) go to E4M3 bits 4..2 (exponent field e, top mantissa bit m:
    2^(e - 7) (1 + m/2) = 2^-6 * 2^(e - 1) (1 + m/2), and for e = 0 the subnormal m/2 * 2^-6), the sign to bit 7
    (code 8 gives -0.0). No NaN byte can arise (magnitudes stay <= 0x1C)."""
    lo = ((packed & 7) << 2) | ((packed & 8) << 4)
    hi = ((packed >> 2) & 0x1C) | (packed & 0x80)
    as_e4m3 = lambda b: lax.bitcast_convert_type(b, jnp.float8_e4m3fn)  # noqa: E731
    return as_e4m3(lo), as_e4m3(hi)


def e8m0_to_float(b):
    """E8M0 bytes (uint8 or int32 in [0, 255)) -> float32 2^(b - 127); byte 255 (NaN) is refused at load."""
    b = b.astype(jnp.int32)
    return jnp.where(b == 0, jnp.float32(E8M0_ZERO), lax.bitcast_convert_type(b << 23, jnp.float32))


def e8m0_to_float_max(b):
    """`e8m0_to_float` as a max instead of a compare and select (for kernels that convert a scale per weight): b << 23
    is 2^(b - 127) for b >= 1 and +0 for b = 0, which max(., 2^-127) lifts to byte 0's value (platforms that treat
    subnormal inputs as zero give +0 there, as they treat the constant: the products agree bitwise, tested)."""
    return jnp.maximum(lax.bitcast_convert_type(b.astype(jnp.int32) << 23, jnp.float32), jnp.float32(E8M0_ZERO))


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
