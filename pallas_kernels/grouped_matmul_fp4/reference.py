"""Grouped matmul with MXFP4 weights — the specification (pure jnp).

Like `grouped_matmul_reference` (y[r] = x[r] @ W[tile_group[r // tile_m]], f32 accumulation, empty tiles give
zeros), with each weight given as (packed [g, k/2, n] uint8: row j holds inputs 2j (low nibble) and 2j + 1 (high),
scales [g, k/32, n] uint8 E8M0): W = e2m1(code) * 2^(scale - 127).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels._mxfp4 import dequantize_fp4
from pallas_kernels.grouped_matmul.reference import grouped_matmul_dequantized


def grouped_matmul_fp4_reference(x, ws, tile_group, *, block_sizes=None, interpret=False):
    """x [r, k], ws: tuple of (packed [g, k/2, n], scales [g, k/32, n]), tile_group [tiles] -> tuple of [r, n] f32.

    Only the tiles' own experts are dequantized (a gather first), so unused experts' bytes are never read."""
    del block_sizes, interpret
    return grouped_matmul_dequantized(x.astype(jnp.float32), ws, tile_group,
                                      lambda packed, scales: dequantize_fp4(packed, scales, jnp.float32))
