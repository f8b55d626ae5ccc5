"""Input checks for the FP8 grouped matmul (static: shapes/dtypes at trace time)."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels._fp8 import is_fp8
from pallas_kernels._util import cdiv
from pallas_kernels.grouped_matmul.validate import validate_tiles


def validate_grouped_matmul_fp8_static(x, ws, tile_group, block) -> None:
    """Raise ValueError naming the offending argument."""
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating) or is_fp8(x.dtype):
        raise ValueError(f"x must be [rows, k] bf16/f32, got {x.dtype}{list(x.shape)}")
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"block must be (rows, cols) >= 1, got {block}")
    if not ws:
        raise ValueError("ws must hold at least one (values, scales) weight")
    k = x.shape[1]
    for i, (values, scales) in enumerate(ws):
        if (values.ndim != 3 or not is_fp8(values.dtype) or values.shape[1] != k
                or values.shape != ws[0][0].shape or values.dtype != ws[0][0].dtype):
            raise ValueError(f"ws[{i}] values must be float8_e4m3fn / float8_e4m3fnuz [groups, k={k}, n] like ws[0], "
                             f"got {values.dtype}{list(values.shape)}")
        groups, _, n = values.shape
        want = (groups, cdiv(k, block[0]), cdiv(n, block[1]))
        if scales.dtype != jnp.float32 or tuple(scales.shape) != want:
            raise ValueError(f"ws[{i}] scales must be f32 {list(want)} (one per {tuple(block)} block of values), got "
                             f"{scales.dtype}{list(scales.shape)}")
    validate_tiles(x, tile_group)
