"""Tile parameters of the indexer top-k kernel and the split heuristic."""

from __future__ import annotations

import dataclasses

from pallas_kernels._util import cdiv

# About two waves of programs on an H200 (132 SMs); decode (few queries) needs splits to get there.
TARGET_PROGRAMS = 264
# Each split fills its own top-m buffer before its threshold starts filtering; keep splits long.
MIN_ENTRIES_PER_SPLIT_OVER_M = 8


@dataclasses.dataclass(frozen=True, slots=True)
class BlockSizes:
    """block_c: entries scored per step ([h, d] x [d, block_c] matmul).
    stage: staging slots for candidates that beat the running threshold (>= block_c); the [m, stage]
      rank merge runs only when the stage is full.
    num_splits: programs per query along the entries (None = heuristic); each keeps its own top-m,
      merged by one sort of [num_splits * m] candidates outside the kernel.
    num_warps, num_stages: Triton launch parameters.
    """

    block_c: int = 32
    stage: int = 32
    num_splits: int | None = None
    num_warps: int = 8
    num_stages: int = 2

    @classmethod
    def get_default(cls) -> BlockSizes:
        return cls()


def choose_num_splits(num_splits: int | None, *, t: int, c: int, m: int, block_c: int) -> int:
    """Splits per query: explicit value, else enough programs for the GPU without very short splits."""
    total_blocks = max(1, cdiv(c, block_c))
    if num_splits is None:
        num_splits = min(cdiv(TARGET_PROGRAMS, max(1, t)), max(1, c // (MIN_ENTRIES_PER_SPLIT_OVER_M * m)))
    return max(1, min(num_splits, total_blocks))
