"""Input checks for the FP8 dense matmul (static: shapes/dtypes at trace time)."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels._fp8 import is_fp8
from pallas_kernels._util import cdiv


def validate_fp8_matmul_static(x, values, scales, block, layer=None) -> None:
    """Raise ValueError naming the offending argument. `layer` given: values and scales are stacks of layers."""
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating) or is_fp8(x.dtype):
        raise ValueError(f"x must be [m, k] bf16/f32, got {x.dtype}{list(x.shape)}")
    lead = () if layer is None else values.shape[:1]
    if layer is not None and (jnp.shape(layer) != () or not jnp.issubdtype(jnp.result_type(layer), jnp.integer)):
        raise ValueError(f"layer must be an integer scalar, got {jnp.result_type(layer)}{list(jnp.shape(layer))}")
    if values.ndim != 2 + len(lead) or not is_fp8(values.dtype) or values.shape[len(lead)] != x.shape[1]:
        what = "[k={}, n]" if layer is None else "[layers, k={}, n] (with layer)"
        raise ValueError(f"values must be float8_e4m3fn / float8_e4m3fnuz {what.format(x.shape[1])}, got "
                         f"{values.dtype}{list(values.shape)}")
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"block must be (rows, cols) >= 1, got {block}")
    want = (*lead, cdiv(values.shape[-2], block[0]), cdiv(values.shape[-1], block[1]))
    if scales.dtype != jnp.float32 or tuple(scales.shape) != want:
        raise ValueError(f"scales must be f32 {list(want)} (one per {block} block of values), got "
                         f"{scales.dtype}{list(scales.shape)}")
