"""Input checks for the grouped matmul (static: shapes/dtypes at trace time)."""

from __future__ import annotations

import jax.numpy as jnp


def validate_grouped_matmul_static(x, ws, tile_group) -> None:
    """Raise ValueError naming the offending argument."""
    if x.ndim != 2:
        raise ValueError(f"x must be [rows, k], got shape {x.shape}")
    if not ws:
        raise ValueError("ws must hold at least one weight")
    for i, w in enumerate(ws):
        if w.ndim != 3 or w.shape[1] != x.shape[1] or w.shape != ws[0].shape:
            raise ValueError(f"ws[{i}] must be [groups, k={x.shape[1]}, n] like ws[0], got shape {w.shape}")
        if w.dtype != x.dtype:
            raise ValueError(f"ws[{i}] dtype {w.dtype} must equal x dtype {x.dtype}")
    validate_tiles(x, tile_group)


def validate_tiles(x, tile_group) -> None:
    """The tile table of every grouped matmul (bf16, FP4, FP8 weights): [tiles] int32, x rows a whole number of
    tiles."""
    if tile_group.ndim != 1 or tile_group.dtype != jnp.int32:
        raise ValueError(f"tile_group must be [tiles] int32, got {tile_group.dtype}{list(tile_group.shape)}")
    if tile_group.shape[0] == 0 or x.shape[0] % tile_group.shape[0]:
        raise ValueError(f"x rows ({x.shape[0]}) must be a whole number of tiles ({tile_group.shape[0]})")
