"""Grouped matmul with block-scaled FP8 weights — the specification (pure jnp).

Like `grouped_matmul_reference` (y[r] = x[r] @ W[tile_group[r // tile_m]], f32 accumulation, empty tiles give
zeros), with each weight given as (values [g, k, n] float8_e4m3fn or float8_e4m3fnuz, scales [g, ceil(k/bi),
ceil(n/bo)] f32) for block = (bi, bo): W[e, i, o] = float(values[e, i, o]) * scales[e, i // bi, o // bo], rounded
to x's dtype before the matmul (what a dequantize-then-dot computes; `fp8_matmul_reference` per expert).
"""

from __future__ import annotations

from pallas_kernels.fp8_matmul.reference import dequantize_fp8
from pallas_kernels.grouped_matmul.reference import grouped_matmul_dequantized


def grouped_matmul_fp8_reference(x, ws, tile_group, *, block=(128, 128), block_sizes=None, interpret=False):
    """x [r, k], ws: tuple of (values [g, k, n], scales [g, ceil(k/bi), ceil(n/bo)]), tile_group [tiles] -> tuple
    of [r, n] f32.

    Only the tiles' own experts are dequantized (a gather first), so unused experts' bytes are never read."""
    del block_sizes, interpret
    return grouped_matmul_dequantized(x, ws, tile_group,
                                      lambda values, scales: dequantize_fp8(values, scales, tuple(block), x.dtype))
