"""Tile parameters of the FP8 dense matmul (its own file so per-architecture defaults live here)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels._util import next_pow2

DECODE_ROWS = 16  # up to this many rows one row tile covers them all (Triton's smallest dot extent)


@dataclasses.dataclass(frozen=True, slots=True)
class BlockSizes:
    """tile_m: rows per program; block_n: output columns per program; block_k: reduction step (one FP8 weight tile
    [block_k, block_n] and its one f32 scale per step: the tile must lie inside one scale block, so block_k and
    block_n are cut to powers of two dividing it); k_splits: programs along k per (row tile, column block), None =
    the grouped matmul's heuristic (decode: enough programs stream the weight; partials are summed in f32 by the
    wrapper); num_warps, num_stages: Triton launch parameters.

    Shared memory per stage: tile_m * block_k * itemsize(x) + block_k * block_n bytes (FP8), times the buffered
    stages, plus the tile decoded to x's dtype for the MMA. bf16 defaults, compiled with pip Triton 3.6 on a CPU
    host (`tests/rocm/test_fp8_kernel_compile.py`): decode (16 x 64 x 64, 3 stages) 20 KB shared on sm90, 12 KB LDS
    on gfx942 / gfx950; prefill (64 x 64 x 64, 2 stages) 28 KB / 16 KB; no spills. Not yet timed on a GPU (wider
    prefill tiles fit too: 64 x 64 x 128 / 3 stages 56 KB on sm90, 32 KB on gfx942). f32 halves block_k, as in
    the grouped matmul.
    """

    tile_m: int = DECODE_ROWS
    block_n: int = 64
    block_k: int = 64
    k_splits: int | None = None
    num_warps: int = 4
    num_stages: int = 3

    @classmethod
    def get_default(cls, dtype=None, rows: int = 1, arch: str | None = None) -> BlockSizes:
        """Decode tiles for up to 16 rows, 64-row tiles beyond; one choice for every architecture (`arch`
        accepted for the dispatcher's interface)."""
        del arch
        block_k = 32 if dtype is not None and jnp.dtype(dtype).itemsize == 4 else 64
        if rows > DECODE_ROWS:
            return cls(tile_m=64, block_k=block_k, num_stages=2)
        return cls(block_k=block_k)


def fit_block(want: int, scale_block: int, extent: int, floor: int) -> int:
    """The largest power of two <= `want` that divides `scale_block` (a tile never straddles two scales), shrunk
    towards the array's `extent` but not below `floor` (the backend's smallest dot extent). Shared with the FP8
    grouped matmul."""
    size = 1
    while size * 2 <= want and scale_block % (size * 2) == 0:
        size *= 2
    if size < floor:
        raise ValueError(f"the FP8 scale block side {scale_block} has no power-of-two divisor >= {floor} "
                         f"(a tile must lie inside one scale block)")
    return max(floor, min(size, next_pow2(extent)))


def tiles(bs: BlockSizes, block: tuple[int, int], m: int, k: int, n: int, min_dot: int) -> tuple[int, int, int]:
    """(tile_m, block_k, block_n) the kernel runs with for an [m, k] x [k, n] product with scale `block`."""
    tile_m = max(min_dot, min(next_pow2(bs.tile_m), next_pow2(m)))
    return tile_m, fit_block(bs.block_k, block[0], k, min_dot), fit_block(bs.block_n, block[1], n, min_dot)
