"""Tile parameters of the FP4 grouped matmul."""

from __future__ import annotations

import dataclasses

DOTS = ("tile", "group")
DECODES = ("bits", "arith")


@dataclasses.dataclass(frozen=True, slots=True)
class BlockSizes:
    """block_n: output columns per program; block_j: packed weight rows per step (2 * block_j inputs, a multiple
    of 16 so a step covers whole 32-input scale groups); k_splits: programs along the inputs (None = the
    grouped matmul's heuristic); num_warps, num_stages: Triton launch parameters.

    Shared memory per stage: 2 * tile_m * block_j * itemsize (x, even and odd inputs) + 2 * len(ws) * block_j *
    block_n bytes (packed values, scale bytes): 20 KB at the defaults for gate + up (bf16, tile_m 16), far inside
    MI300's 64 KB. The weights are decoded to x's dtype in registers; no FP4 instruction is used.
    """

    block_n: int = 64
    block_j: int = 64
    k_splits: int | None = None
    num_warps: int = 4
    num_stages: int = 3
    dots: str = "tile"
    decode: str = "bits"

    def validate(self) -> None:
        if self.dots not in DOTS or self.decode not in DECODES:
            raise ValueError(f"dots must be one of {DOTS} and decode one of {DECODES}, got {self.dots!r}, "
                             f"{self.decode!r}")

    @classmethod
    def get_default(cls, dtype=None, tile_m: int = 16, arch: str | None = None) -> "BlockSizes":
        """One tile for every architecture (`arch` accepted for the dispatcher's interface)."""
        del dtype, arch
        return cls(num_stages=2) if tile_m > 16 else cls()
