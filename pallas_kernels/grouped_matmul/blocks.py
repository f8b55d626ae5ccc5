"""Tile parameters of the grouped matmul (its own file so per-architecture defaults live here)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels._util import cdiv

# Architectures with ~227 KB of shared memory per block (Hopper, datacenter Blackwell): the wide prefill tile
# needs 221 KB; sm80 (163 KB), sm89 / sm120 (~100 KB) and every ROCm target (64 KB LDS on MI300) do not have it
WIDE_SHARED_MEMORY = ("sm90", "sm100")
# Programs that keep every SM of an H200 (132) streaming weights with a few programs each; MI300X has 304 CUs.
TARGET_PROGRAMS = 4 * 132
MIN_K_BLOCKS_PER_SPLIT = 4


@dataclasses.dataclass(frozen=True, slots=True)
class BlockSizes:
    """block_n: output columns per program; block_k: reduction step (one weight tile [block_k, block_n] per weight
    and step); k_splits: programs along k per (tile, column block), None = heuristic (decode has few tiles:
    splitting k keeps enough programs reading weights; partials are summed in f32 by the wrapper);
    num_warps, num_stages: Triton launch parameters.

    Shared memory per stage: (tile_m + len(ws) * block_n) * block_k * itemsize, times the buffered stages. The
    defaults stay within the 64 KB of an MI300 CU's LDS on every target (`tests/rocm/test_kernel_compile.py`
    compiles them; sm_90 bf16: 36 / 20 / 48 KB for decode gate+up / decode down / prefill gate+up); f32 halves
    block_k for that (its 64-deep tiles took 72 KB on gfx942).
    """

    block_n: int = 64
    block_k: int = 64
    k_splits: int | None = None
    num_warps: int = 4
    num_stages: int = 3

    @classmethod
    def get_default(cls, dtype=None, tile_m: int = 16, arch: str | None = None) -> "BlockSizes":
        """Tiles that fit MI300's LDS on every target, except bf16 prefill tiles where `WIDE_SHARED_MEMORY`.

        Prefill (tile_m 64) re-reads a tile's rows once per column block: on an H100 (`bench_kernels.py --ops
        bf16_gate_up,bf16_down --sweep --sweep-at 2048:0`, docs/benchmarks/kernels_grouped_prefill_h100.md)
        block_n 256, block_k 64, 8 warps, 3 stages (221 KB of shared memory for gate + up: `WIDE_SHARED_MEMORY`
        targets only) took 3.44 / 2.00 ms for gate + up / down at 2048 tokens against 4.70 / 3.01 ms for the tile
        below (89 / 81 % of the bandwidth against 65 / 54 %)."""
        wide = dtype is not None and jnp.dtype(dtype).itemsize == 4
        block_k = 32 if wide else 64
        if tile_m > 16 and not wide and arch in WIDE_SHARED_MEMORY:
            return cls(block_n=256, block_k=64, num_warps=8, num_stages=3)
        if tile_m > 16:  # prefill tiles: fewer stages keep (64 + 2 * 64) x 64 bf16 x 2 stages = 48 KB
            return cls(block_k=block_k, num_stages=2)
        return cls(block_k=block_k)


def choose_k_splits(k_splits: int | None, *, tiles: int, n_blocks: int, k_blocks: int) -> int:
    if k_splits is None:
        k_splits = cdiv(TARGET_PROGRAMS, max(1, tiles * n_blocks))
        k_splits = min(k_splits, max(1, k_blocks // MIN_K_BLOCKS_PER_SPLIT))
    k_splits = max(1, min(k_splits, k_blocks))
    while k_blocks % k_splits:  # whole k blocks per split
        k_splits -= 1
    return k_splits
