"""Launch parameters of the mHC pre-step kernel."""

from __future__ import annotations

import dataclasses

from pallas_kernels._util import cdiv, next_pow2


@dataclasses.dataclass(frozen=True, slots=True)
class BlockSizes:
    """block_tokens: tokens per program (a power of two); tile_elements: f32 values of one streams tile
    [tokens, next_pow2(m), hidden chunk] (sets the hidden chunk; a power of two); num_warps / num_stages: Triton's.

    Each block of tokens is two programs: one collapses and normalises the streams, one projects the comb weights
    (Sinkhorn's serial rounds), so their latencies overlap. Up to `kernel.MAX_RESIDENT_CHUNKS` chunks a token's
    streams are loaded once and kept in registers. A token a program, 4 warps, 8K values a tile (Flash: 2 chunks of
    2048) was the fastest on an H100 at 1, 8 and 2048 tokens (4.6 us a call at decode, against 9.2 us at 8 tokens a
    program and 8 warps; `scripts/bench_mhc.py`); no shared memory beyond the reductions' scratch, so the same tiles
    serve MI300 (`docs/benchmarks/rocm_kernels.md`)."""

    block_tokens: int = 1
    tile_elements: int = 8192
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        for name in ("block_tokens", "tile_elements"):
            v = getattr(self, name)
            if v < 1 or next_pow2(v) != v:
                raise ValueError(f"{name}={v} must be a power of two")
        if self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"num_warps={self.num_warps} and num_stages={self.num_stages} must be >= 1")

    @classmethod
    def get_default(cls, dtype=None, arch: str | None = None) -> "BlockSizes":
        """The same tiles everywhere (no shared memory, no MMA); `dtype` and `arch` for the dispatcher's interface."""
        del dtype, arch
        return cls()


def launch_tiles(bs: BlockSizes, tokens: int, m: int, e: int) -> tuple[int, int, int]:
    """(tokens per program, hidden chunk, chunks) for `tokens` tokens of m streams of width e."""
    block = min(bs.block_tokens, next_pow2(tokens))
    chunk = min(next_pow2(e), max(16, bs.tile_elements // (block * next_pow2(m))))
    return block, chunk, cdiv(e, chunk)
