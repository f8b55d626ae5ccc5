"""Launch parameters of the Sinkhorn kernel (its own file so per-architecture defaults live here)."""

from __future__ import annotations

import dataclasses

from pallas_kernels._util import next_pow2

# AMD wavefronts are 64 lanes wide: the same 4 warps hold twice the tokens at one token per lane.
_ROCM_ARCHS = ("gfx942", "gfx950")


@dataclasses.dataclass(frozen=True, slots=True)
class BlockSizes:
    """block_tokens: tokens per program, a power of two (sized for one token per lane: at 128 tokens and 4 warps
    Triton keeps each token's m*m values in one thread's registers through all iterations; a small decode block
    spreads a token over a few lanes, its column sums then shuffles); num_warps: Triton warps per program
    (fewer when the block is smaller than that many lanes); num_stages: Triton stages (no loop loads here).

    A decode step's few tokens (batch x 1) fit one program; a prefill chunk's thousands spread over
    ceil(tokens / block_tokens) programs.
    """

    block_tokens: int = 128
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        if self.block_tokens < 1 or next_pow2(self.block_tokens) != self.block_tokens:
            raise ValueError(f"block_tokens={self.block_tokens} must be a power of two")
        if self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"num_warps={self.num_warps} and num_stages={self.num_stages} must be >= 1")

    @classmethod
    def get_default(cls, dtype=None, arch: str | None = None) -> "BlockSizes":
        """128 tokens x 4 warps (one token per NVIDIA lane); AMD: 256 tokens (one per lane of 4 wave64s).
        `dtype` is accepted for the dispatcher's interface: the math is f32 whatever the input."""
        del dtype
        return cls(block_tokens=256) if arch in _ROCM_ARCHS else cls()


def launch_block(bs: BlockSizes, tokens: int) -> tuple[int, int]:
    """(tokens per program, warps) for `tokens` tokens: a small batch gets one program of next_pow2(tokens) lanes."""
    block = min(bs.block_tokens, next_pow2(tokens))
    return block, max(1, min(bs.num_warps, block // 32))
