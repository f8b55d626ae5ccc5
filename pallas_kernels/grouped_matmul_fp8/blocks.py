"""Tile parameters of the FP8 grouped matmul (its own file so per-architecture defaults live here)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True, slots=True)
class BlockSizes:
    """block_n: output columns per program; block_k: reduction step (one FP8 weight tile [block_k, block_n] and its
    one f32 scale per weight and step: the tile must lie inside one scale block, so both are cut to powers of two
    dividing it, as in `fp8_matmul`); k_splits: programs along k per (tile, column block), None = the grouped
    matmul's heuristic; num_warps, num_stages: Triton launch parameters.

    Shared memory per stage: tile_m * block_k * itemsize(x) + len(ws) * block_k * block_n bytes (FP8), times the
    buffered stages, plus the tiles decoded to x's dtype for the MMA. The grouped matmul's tiles (64 x 64, 3 stages
    at decode, 2 for 64-row prefill tiles), bf16, compiled with pip Triton 3.6 on a CPU host at Flash dims
    (`tests/rocm/test_fp8_grouped_kernel_compile.py`): sm90 28 / 20 / 32 / 28 KB shared for decode gate+up / decode
    down / prefill gate+up / prefill down, 12 / 12 / 16 / 16 KB LDS on gfx942 and gfx950; no spills. Not yet timed
    on a GPU. f32 halves block_k, as in the grouped matmul.
    """

    block_n: int = 64
    block_k: int = 64
    k_splits: int | None = None
    num_warps: int = 4
    num_stages: int = 3

    @classmethod
    def get_default(cls, dtype=None, tile_m: int = 16, arch: str | None = None) -> "BlockSizes":
        """One tile for every architecture (`arch` accepted for the dispatcher's interface)."""
        del arch
        block_k = 32 if dtype is not None and jnp.dtype(dtype).itemsize == 4 else 64
        if tile_m > 16:
            return cls(block_k=block_k, num_stages=2)
        return cls(block_k=block_k)
