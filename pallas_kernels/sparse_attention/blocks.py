"""Tile parameters of the sparse attention kernel and the split heuristic."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels._util import cdiv

# One wave of programs on an H200 (132 SMs; the default tile runs one 8-warp program per SM).
TARGET_PROGRAMS = 132
# Splits write f32 partials ([block_h, d] per program, about a third of a token's rows at Flash decode
# dims) that XLA then re-reads: split only while fewer than half the SMs would be busy without.
SPLIT_BELOW_PROGRAMS = TARGET_PROGRAMS // 2
MIN_BLOCKS_PER_SPLIT = 2


@dataclasses.dataclass(frozen=True, slots=True)
class BlockSizes:
    """block_h: query heads per program (MQA: one gathered K block serves all of them).
    block_k: rows per block (gather + online-softmax step).
    num_splits: programs per token along the row lists (None = heuristic); > 1 returns partials
      that are merged with `reference.merge_partials`.
    num_warps, num_stages: Triton launch parameters.
    prefetch: row blocks gathered ahead of the one being computed, held in registers across loop steps
      (0 = gather and use in one step and leave overlap to Triton's pipeliner, which for these index-
      dependent gathers issues the next copy only after the current math and then waits for it). Prefetch
      re-reads q every step (held, it would spill) and measured slower on the H200 (`get_default`).
    """

    block_h: int = 32
    block_k: int = 64
    num_splits: int | None = None
    num_warps: int = 8
    num_stages: int = 2
    prefetch: int = 0

    @classmethod
    def get_default(cls, dtype=None, arch: str | None = None) -> BlockSizes:
        """bf16: 32 heads x 64 rows, 8 warps, 2 stages, no register prefetch: the fastest tile measured on the
        H200 (48 us CSA / 79 us HCA at batch 64, 128k; 32-row blocks 68 / 116 us, 32-row blocks with
        prefetch 2: 74 / 127 us). ptxas sm_90 (Triton 3.6): 173 registers, no spills, 100 KB shared.
        f32 (IEEE dots, the correctness path): 16 heads x 16 rows, 3 stages.

        arch "gfx942" / "gfx950" (MI300 / MI355, 64-wide wavefronts): the H200 tile spills hundreds of VGPRs there
        and fills MI300's 64 KB of LDS, so ROCM_DEFAULTS holds the largest tiles that compile without VGPR
        spills (pip triton 3.6; docs/benchmarks/rocm_kernels.md). Chosen from compile-time resources, not timed."""
        f32 = dtype is not None and jnp.dtype(dtype).itemsize == 4
        if arch in ROCM_DEFAULTS:
            return cls(**ROCM_DEFAULTS[arch]["float32" if f32 else "bfloat16"])
        if f32:
            return cls(block_h=16, block_k=16, num_stages=3)
        return cls()


# Per AMD architecture and dtype (keyword arguments of BlockSizes), from scripts/rocm_kernels.py and a tile sweep:
# bf16 gfx942: 16 x 32 rows, 8 waves, 1 stage: 254 VGPRs, no spills, 32 KB LDS, 2 waves/SIMD (16 x 64: 2 spills;
#   the H200's 32 x 64: ~450 spilled VGPRs). gfx950 has the registers for 16 x 64 rows without spills.
# f32: the H200's 16 x 16 tile with 2 stages (no spills; 1 stage spills ~120 VGPRs, 16 x 32 needs 66 KB of LDS).
ROCM_DEFAULTS = {
    "gfx942": {"bfloat16": dict(block_h=16, block_k=32, num_warps=8, num_stages=1),
               "float32": dict(block_h=16, block_k=16, num_warps=8, num_stages=2)},
    "gfx950": {"bfloat16": dict(block_h=16, block_k=64, num_warps=8, num_stages=1),
               "float32": dict(block_h=16, block_k=16, num_warps=8, num_stages=2)},
}


def choose_num_splits(num_splits: int | None, *, t: int, head_blocks: int, total_blocks: int) -> int:
    """Splits per token: explicit value, else 1 unless (token, head block) programs leave most SMs idle."""
    if num_splits is None:
        programs = max(1, t * head_blocks)
        if programs >= SPLIT_BELOW_PROGRAMS:
            return 1
        num_splits = min(cdiv(TARGET_PROGRAMS, programs), cdiv(total_blocks, MIN_BLOCKS_PER_SPLIT))
    return max(1, min(num_splits, total_blocks))
