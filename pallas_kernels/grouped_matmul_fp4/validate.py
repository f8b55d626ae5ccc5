"""Input checks for the FP4 grouped matmul (static: shapes/dtypes at trace time)."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.grouped_matmul.validate import validate_tiles

FP4_GROUP = 32  # inputs per E8M0 scale


def validate_grouped_matmul_fp4_static(x, ws, tile_group) -> None:
    """Raise ValueError naming the offending argument."""
    if x.ndim != 2:
        raise ValueError(f"x must be [rows, k], got shape {x.shape}")
    k = x.shape[1]
    if k % FP4_GROUP:
        raise ValueError(f"x's k={k} must be a multiple of {FP4_GROUP} (one E8M0 scale per 32 inputs)")
    if not ws:
        raise ValueError("ws must hold at least one (packed, scales) weight")
    for i, (packed, scales) in enumerate(ws):
        groups, n = packed.shape[0], packed.shape[-1]
        if packed.dtype != jnp.uint8 or packed.shape != (groups, k // 2, n) or packed.shape != ws[0][0].shape:
            raise ValueError(f"ws[{i}] packed must be uint8 [groups, k/2={k // 2}, n] like ws[0], got "
                             f"{packed.dtype}{list(packed.shape)}")
        if scales.dtype != jnp.uint8 or scales.shape != (groups, k // FP4_GROUP, n):
            raise ValueError(f"ws[{i}] scales must be uint8 E8M0 [groups, k/32={k // FP4_GROUP}, n={n}], got "
                             f"{scales.dtype}{list(scales.shape)}")
    validate_tiles(x, tile_group)


def validate_grouped_gemv_fp4_static(x, ws, group) -> None:
    """The GEMV form (`gemv.grouped_gemv_fp4`): the same weights, and one group per row of x."""
    if group.ndim != 1 or group.shape[0] != x.shape[0]:
        raise ValueError(f"group must be [rows={x.shape[0]}] int32 (one expert per row), got "
                         f"{group.dtype}{list(group.shape)}")
    validate_grouped_matmul_fp4_static(x, ws, group)
