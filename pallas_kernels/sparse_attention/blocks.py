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
      dependent gathers issues the next copy only after the current math and then waits for it).
    """

    block_h: int = 32
    block_k: int = 32
    num_splits: int | None = None
    num_warps: int = 8
    num_stages: int = 1
    prefetch: int = 2

    @classmethod
    def get_default(cls, dtype=None) -> BlockSizes:
        """bf16: 32 heads x 32 rows, 8 warps. f32 (IEEE dots, twice the bytes per row): 16 x 16.
        ptxas on sm_90 (Triton 3.9, d=512): 169 / 184 registers, no spills, 66-68 KB shared memory."""
        if dtype is not None and jnp.dtype(dtype).itemsize == 4:
            return cls(block_h=16, block_k=16)
        return cls()


def choose_num_splits(num_splits: int | None, *, t: int, head_blocks: int, total_blocks: int) -> int:
    """Splits per token: explicit value, else 1 unless (token, head block) programs leave most SMs idle."""
    if num_splits is None:
        programs = max(1, t * head_blocks)
        if programs >= SPLIT_BELOW_PROGRAMS:
            return 1
        num_splits = min(cdiv(TARGET_PROGRAMS, programs), cdiv(total_blocks, MIN_BLOCKS_PER_SPLIT))
    return max(1, min(num_splits, total_blocks))
