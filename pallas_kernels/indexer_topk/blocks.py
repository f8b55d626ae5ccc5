"""Tile parameters of the indexer top-k kernels and the split heuristic."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels._util import cdiv, next_pow2

# One program per SM of an H200 (132 SMs; the score kernel runs one 8-warp program per SM).
TARGET_PROGRAMS = 132
# A split keeps m = next_pow2(k) candidates out of its entries: keep splits several times longer than m,
# or the candidate sort (the second kernel, O(candidates^2) per query) outgrows the scoring.
MIN_SPLIT_OVER_M = 4


@dataclasses.dataclass(frozen=True, slots=True)
class BlockSizes:
    """block_c: entries scored per step ([h, d] x [d, block_c] matmul); a power of two.
    max_split: most entries one program scores: their f32 scores stay in registers as a
      [max_split / block_c, block_c] tile (max_split / (32 * num_warps) registers per thread).
    num_splits: programs per query along its entries (None = heuristic); each selects its exact top m.
    num_warps, num_stages: Triton launch parameters of the scoring kernel.
    rank_block: candidates per program of the ranking kernel (which orders the [splits * m] candidates).
    prefetch: 1 = gather block r + 1 while block r is scored (loop-carried registers); 0 = gather and use
      in one step, leaving overlap to Triton's pipeliner (for these index-dependent gathers it issues the
      next copy after the math and waits for it at the top of the next step: little overlap).
    """

    block_c: int = 128
    max_split: int = 16384
    num_splits: int | None = None
    num_warps: int = 8
    num_stages: int = 3
    rank_block: int = 128
    prefetch: int = 0

    @classmethod
    def get_default(cls, dtype=None, arch: str | None = None) -> BlockSizes:
        """bf16: 128-entry blocks, up to 16384 entries per program, 8 warps, 3 stages, no register prefetch
        (ptxas sm_90, Triton 3.6: 254 registers, no spills, 84 KB shared; on the H200 52 us at batch 1 / 8k
        against 55 us for the prefetch variant with 16 warps). f32 (IEEE dots, the correctness path):
        16-entry blocks, 2048 entries per program, 2 stages (66 registers; larger f32 tiles spill).
        arch "gfx942" / "gfx950": ROCM_DEFAULTS (chosen from compile-time resources, not timed)."""
        f32 = dtype is not None and jnp.dtype(dtype).itemsize == 4
        if arch in ROCM_DEFAULTS:
            return cls(**ROCM_DEFAULTS[arch]["float32" if f32 else "bfloat16"])
        if f32:
            return cls(block_c=16, max_split=2048, num_stages=2)
        return cls()


# Per AMD architecture and dtype (keyword arguments of BlockSizes), from scripts/rocm_kernels.py and a tile sweep:
# the H200 tile with one stage: 117 VGPRs and 4 waves/SIMD on gfx942 (3 stages: 165 VGPRs, 2 waves/SIMD); the
# pipeliner's buffers buy nothing on these index-dependent gathers. A 16384-entry split's selection passes its
# [128, 128] f32 score tile through 64 KB of LDS: all of MI300's, so gfx942 takes 8192-entry splits (32 KB).
# f32 keeps the H200 tile (one stage measured 165 VGPRs against 151 with two).
_ROCM_F32 = dict(block_c=16, max_split=2048, num_warps=8, num_stages=2)
ROCM_DEFAULTS = {
    "gfx942": {"bfloat16": dict(block_c=128, max_split=8192, num_warps=8, num_stages=1), "float32": _ROCM_F32},
    "gfx950": {"bfloat16": dict(block_c=128, max_split=16384, num_warps=8, num_stages=1), "float32": _ROCM_F32},
}


def choose_split_len(bs: BlockSizes, *, t: int, c: int, m: int, block_c: int) -> int:
    """Entries per program: a power-of-two number of blocks, at most `max_split` (rounded to blocks).

    Explicit num_splits, else: as few splits as the register tile allows, more only while the GPU has
    idle SMs and each split keeps at least MIN_SPLIT_OVER_M * m entries.
    """
    max_rows = max(1, bs.max_split // block_c)
    max_rows = 1 << (max_rows.bit_length() - 1)  # power of two
    total_blocks = max(1, cdiv(c, block_c))
    if bs.num_splits is not None:
        n_splits = max(1, min(bs.num_splits, total_blocks))
    else:
        n_splits = cdiv(total_blocks, max_rows)
        if t * n_splits < TARGET_PROGRAMS:
            want = cdiv(TARGET_PROGRAMS, max(1, t))
            n_splits = max(n_splits, min(want, c // (MIN_SPLIT_OVER_M * m)))
    rows = min(max_rows, next_pow2(cdiv(total_blocks, n_splits)))
    return rows * block_c
