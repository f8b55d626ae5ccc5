"""Tile parameters of the sparse attention kernel and the split heuristic."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels._util import cdiv

# About two waves of programs on an H200 (132 SMs); decode needs splits to get there.
TARGET_PROGRAMS = 264
# A split writes a [block_h, d] f32 partial: keep it small next to the rows it reads.
MIN_BLOCKS_PER_SPLIT = 4


@dataclasses.dataclass(frozen=True, slots=True)
class BlockSizes:
    """block_h: query heads per program (MQA: one gathered K block serves all of them).
    block_k: rows per block (gather + online-softmax step).
    num_splits: programs per token along the row lists (None = heuristic); > 1 returns partials
      that are merged with `reference.merge_partials`.
    num_warps, num_stages: Triton launch parameters.
    """

    block_h: int = 32
    block_k: int = 32
    num_splits: int | None = None
    num_warps: int = 8
    num_stages: int = 2

    @classmethod
    def get_default(cls, dtype=None) -> BlockSizes:
        """bf16: 32 heads x 32 rows, 8 warps. f32 (IEEE dots, twice the bytes per row): 16 x 16.
        ptxas on sm_90 (Triton 3.9, d=512): 169 / 184 registers, no spills, 66-68 KB shared memory."""
        if dtype is not None and jnp.dtype(dtype).itemsize == 4:
            return cls(block_h=16, block_k=16)
        return cls()


def choose_num_splits(num_splits: int | None, *, t: int, head_blocks: int, total_blocks: int) -> int:
    """Splits per token: explicit value, else enough programs to fill the GPU (1 when t is large)."""
    if num_splits is None:
        num_splits = cdiv(TARGET_PROGRAMS, max(1, t * head_blocks))
        num_splits = min(num_splits, cdiv(total_blocks, MIN_BLOCKS_PER_SPLIT))
    return max(1, min(num_splits, total_blocks))
