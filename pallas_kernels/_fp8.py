"""FP8 E4M3 pool rows inside the kernels: decoded in registers right after the gather, usable in kernels (Triton,
interpreter) and plain XLA alike.

A pool in FP8 comes with one float32 scale per row (x = value * scale). The kernels fold that scale into the
small [heads, rows] tiles (logits and probabilities) rather than into the [rows, d] tile, and convert the E4M3
values themselves exactly to the compute dtype (every E4M3 value is a bf16 value):

* ``float8_e4m3fn`` (OCP: NVIDIA, MI355, CPU): the native conversion (one cvt per pair on sm90);
* ``float8_e4m3fnuz`` (MI300): Pallas' Triton lowering has no FNUZ conversion, so the wrapper hands the kernel
  the pool's bytes (a free bitcast) and `e4m3fnuz_to_float` decodes them with integer ops. FNUZ's exponent bias
  is 8, OCP's 7: the same byte means half the value, which the decode accounts for (reading FNUZ bytes as OCP
  would double every key).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e4m3fnuz))
FNUZ = jnp.dtype(jnp.float8_e4m3fnuz)


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) in FP8_DTYPES


def kernel_operand(pool):
    """What a kernel receives for a pool: FNUZ as its uint8 bytes (see the module docstring), anything else as is."""
    return lax.bitcast_convert_type(pool, jnp.uint8) if jnp.dtype(pool.dtype) == FNUZ else pool


def e4m3fnuz_to_float(b):
    """FNUZ E4M3 bytes (uint8 / int32) -> float32. Byte 0x80 (FNUZ's NaN, never written by a quantizer) reads 0."""
    b = b.astype(jnp.int32)
    mag = b & 0x7F
    # normal: exponent field e -> e + (127 - 8), mantissa m -> m << 20: (1 + m/8) * 2^(e - 8)
    normal = lax.bitcast_convert_type((mag << 20) + ((127 - 8) << 23), jnp.float32)
    subnormal = (mag & 7).astype(jnp.float32) * 2.0**-10  # e == 0: m/8 * 2^(1 - 8)
    value = jnp.where((mag >> 3) == 0, subnormal, normal)
    return jnp.where((b & 0x80) != 0, -value, value)


def to_compute(rows, dtype):
    """Gathered pool rows (a kernel operand: E4M3, FNUZ bytes as uint8, or already `dtype`) -> `dtype`, exactly."""
    if rows.dtype == jnp.uint8:
        return e4m3fnuz_to_float(rows).astype(dtype)
    return rows.astype(dtype)


def check_pool_dtype(name: str, pool, pool_scale, dtype, scale_name: str | None = None) -> None:
    """A kernel's pool operand is in the compute dtype without scales, or FP8 E4M3 with one f32 scale per row;
    anything else raises ValueError naming the argument."""
    scale_name = scale_name or f"{name}_scale"
    if pool_scale is None:
        if pool.dtype != dtype:
            raise ValueError(f"{name} dtype {pool.dtype} must equal q dtype {dtype} (or be FP8 E4M3 with {scale_name})")
        return
    if not is_fp8(pool.dtype):
        raise ValueError(f"{scale_name} is given, so {name} must be float8_e4m3fn / float8_e4m3fnuz, got {pool.dtype}")
    if pool_scale.shape != pool.shape[:1] or pool_scale.dtype != jnp.float32:
        raise ValueError(f"{scale_name} must be f32 [rows={pool.shape[0]}], got {pool_scale.dtype} {pool_scale.shape}")
