"""Input checks for the FP8 dense matmul (static: shapes/dtypes at trace time)."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels._fp8 import is_fp8
from pallas_kernels._util import cdiv


def validate_fp8_matmul_static(x, values, scales, block) -> None:
    """Raise ValueError naming the offending argument."""
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating) or is_fp8(x.dtype):
        raise ValueError(f"x must be [m, k] bf16/f32, got {x.dtype}{list(x.shape)}")
    if values.ndim != 2 or not is_fp8(values.dtype) or values.shape[0] != x.shape[1]:
        raise ValueError(f"values must be float8_e4m3fn / float8_e4m3fnuz [k={x.shape[1]}, n], got "
                         f"{values.dtype}{list(values.shape)}")
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"block must be (rows, cols) >= 1, got {block}")
    want = (cdiv(values.shape[0], block[0]), cdiv(values.shape[1], block[1]))
    if scales.dtype != jnp.float32 or tuple(scales.shape) != want:
        raise ValueError(f"scales must be f32 {list(want)} (one per {block} block of values), got "
                         f"{scales.dtype}{list(scales.shape)}")
