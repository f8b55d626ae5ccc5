"""Input checks for the layer matmul (static: shapes and dtypes at trace time)."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels._fp8 import is_fp8


def validate_layer_matmul_static(x, stack, layer) -> None:
    """Raise ValueError naming the offending argument."""
    if x.ndim not in (2, 3) or not jnp.issubdtype(x.dtype, jnp.floating) or is_fp8(x.dtype):
        raise ValueError(f"x must be [m, k] or [groups, m, k] bf16/f32, got {x.dtype}{list(x.shape)}")
    want = "[layers, k={}, n]".format(x.shape[-1]) if x.ndim == 2 else \
        "[layers, groups={}, k={}, n]".format(x.shape[0], x.shape[-1])
    fits = stack.ndim == x.ndim + 1 and stack.shape[-2] == x.shape[-1] and stack.shape[1:-2] == x.shape[:-2]
    if not fits or not jnp.issubdtype(stack.dtype, jnp.floating) or is_fp8(stack.dtype):
        raise ValueError(f"stack must be a bf16/f32 weight stack {want}, got {stack.dtype}{list(stack.shape)} "
                         f"(FP8 stacks go through fp8_matmul with their scales)")
    if jnp.shape(layer) != () or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise ValueError(f"layer must be an integer scalar, got {jnp.result_type(layer)}{list(jnp.shape(layer))}")
