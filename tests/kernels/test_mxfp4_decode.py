"""The kernels' FP4 decoder (`fp4_times_scale`: float bits built directly) equals the specification's value
arithmetic (`e2m1_to_float(code) * e8m0_to_float(byte)`, what `dequantize_fp4` computes) bit for bit, for all 16
codes times all 255 scale bytes: byte 0 (2^-127, a subnormal), the bytes whose products underflow or overflow, and
the signed zeros (code 8; negative products flushed to zero) included."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._mxfp4 import (E4M3_PER_E2M1, dequantize_fp4, e2m1_to_float, e8m0_to_float, e8m0_to_float_max,
                                   fp4_as_e4m3, fp4_times_scale, unpack_fp4)

CODES = np.arange(16, dtype=np.int32)[:, None]  # [16, 1]
BYTES = np.arange(255, dtype=np.uint8)[None, :]  # [1, 255]: 255 is E8M0 NaN, refused at load


def bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint32)


def test_every_code_and_scale_byte_decodes_bitwise_as_the_specification():
    spec = jax.jit(lambda c, b: e2m1_to_float(c) * e8m0_to_float(b))(CODES, BYTES)
    got = jax.jit(lambda c, b: fp4_times_scale(c, e8m0_to_float(b)))(CODES, BYTES)
    np.testing.assert_array_equal(bits(got), bits(spec))
    # the tile kernel converts a scale per weight with a max instead of compare + select: the same products
    got = jax.jit(lambda c, b: fp4_times_scale(c, e8m0_to_float_max(b)))(CODES, BYTES)
    np.testing.assert_array_equal(bits(got), bits(spec))
    # the table is not trivial: both signs, zeros, infinities and the plain powers of two all occur
    assert np.isinf(spec).sum() > 0 and (bits(spec) == 0x80000000).sum() > 0 and np.isfinite(spec).sum() > 3000


def test_dequantize_fp4_agrees_in_bf16():
    """The same table as packed bytes + scales through `dequantize_fp4` (what the reference matmul uses), cast to
    bf16 like the kernel's weights: every packed byte (both nibbles) at every scale byte."""
    packed = np.arange(256, dtype=np.uint8)[:, None].repeat(255, 1)  # packed row j = byte j, in every column
    scales = np.broadcast_to(BYTES, (16, 255))  # column n at scale byte n (16 groups of 32 inputs = 256 rows)
    spec = jax.jit(lambda p, s: dequantize_fp4(p, s, jnp.bfloat16))(packed, scales)
    even, odd = unpack_fp4(jnp.asarray(packed))
    scale = jnp.repeat(e8m0_to_float(jnp.asarray(scales)), 16, axis=0)
    lo, hi = (jax.jit(lambda c, s: fp4_times_scale(c, s).astype(jnp.bfloat16))(c, scale) for c in (even, odd))
    got = jnp.stack([lo, hi], axis=1).reshape(512, 255)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(spec).view(np.uint16))


def test_every_packed_byte_as_e4m3_reads_its_codes_times_two_to_the_minus_6():
    """The GEMV's FP8-conversion decode: both nibbles of all 256 packed bytes, moved into E4M3 bytes and converted,
    are exactly 2^-6 times the E2M1 values, bit for bit (signed zeros included; no NaN byte)."""
    packed = jnp.arange(256, dtype=jnp.uint8)
    lo, hi = jax.jit(fp4_as_e4m3)(packed)
    assert lo.dtype == hi.dtype == jnp.float8_e4m3fn
    even, odd = unpack_fp4(packed)
    for got, codes in ((lo, even), (hi, odd)):
        want = e2m1_to_float(codes) * E4M3_PER_E2M1
        np.testing.assert_array_equal(bits(np.asarray(got.astype(jnp.float32))), bits(want))
    assert not np.isnan(np.asarray(lo.astype(jnp.float32))).any()
