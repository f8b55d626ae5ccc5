"""Tile parameters of the FP4 grouped matmul."""

from __future__ import annotations

import dataclasses

from pallas_kernels._mxfp4 import E4M3_PER_E2M1
from pallas_kernels.grouped_matmul_fp4.decode_f16 import F16_PER_E2M1

DOTS = ("tile", "group")
DECODES = ("bits", "arith", "quarter", "fp8", "f16")  # "quarter" and "fp8": the GEMV's only (`gemv.py`)
# What each decode's weights read as, a fraction of their values; both kernels multiply their inputs by the inverse
# (a power of two: exact, so every product is bitwise x * value, unless x times it leaves float32's range, e.g.
# |x| > 2^113 for "f16", or a scaled weight falls below float32's normals on a device that flushes them)
DECODED_FRACTION = {"bits": 1.0, "arith": 1.0, "quarter": 0.25, "fp8": E4M3_PER_E2M1, "f16": F16_PER_E2M1}


@dataclasses.dataclass(frozen=True, slots=True)
class BlockSizes:
    """block_n: output columns per program; block_j: packed weight rows per step (2 * block_j inputs, a multiple
    of 16 so a step covers whole 32-input scale groups); k_splits: programs along the inputs (None = the
    grouped matmul's heuristic); num_warps, num_stages: Triton launch parameters; dots: "tile" (one block_j-deep
    dot per nibble and step, the scales loaded per packed row) or "group" (the first version: two 16-deep dots
    per scale group); decode: "bits" (`fp4_times_scale`), "arith" (`e2m1_to_float * scale`, the first version) or
    "f16" (`decode_f16.py`: two codes per mask and shift on 32-bit words, through float16; block_n % 4 == 0).

    Shared memory per stage ("tile"): 2 * tile_m * block_j * itemsize (x, even and odd inputs) + 2 * len(ws) *
    block_j * block_n bytes (packed values, and the scale byte of each packed row): Triton 3.6 gives 40 KB for
    decode gate + up (bf16, tile_m 16, 3 stages) and 56 KB for prefill down (tile_m 64, 2 stages) on sm90, inside
    MI300's 64 KB (`tests/rocm/test_fp4_kernel_compile.py`); block_n 128 would not fit (72 KB at decode). The
    loop's instruction count per weight does not depend on block_n / block_j / num_warps (sm90 SASS: 12.9 a
    nibble at 64 x 64, 64 x 32, 128 x 64 with 8 warps): the defaults stay, chosen for the LDS budget and for
    enough programs at decode. The weights are decoded to x's dtype in registers; no FP4 instruction is used.
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
        """16-row tiles (verification, short prefills) decode "f16" at 3 stages on every architecture; prefill's
        64-row tiles decode "f16" at 3 stages on NVIDIA (`arch` "sm*") and keep "bits" at 2 stages elsewhere (AMD,
        and None: interpreted or unknown).

        H200, device time, Flash dims, one run (docs/benchmarks/fp4_tile_h200/, round 3 session 24): at 8 tokens
        (16-row tiles, 3 stages) "f16" took gate + up 416 us against 461 and down 169 against 221 (1.11x / 1.31x).
        At 2048 tokens (64-row tiles) "f16" at 3 stages took 3.91 / 1.57 ms for gate + up / down against 3.94 / 2.10
        for "bits" at 2 (at 2 stages "f16" lost gate + up, 4.47 ms). It needs 80 KB of shared memory for gate + up
        on sm90 (fine below Hopper's 227 KB, and below the ~100 KB of sm89 / sm120). On gfx942 the same tile
        compiles to 40 KB of LDS (Triton's AMD pipeliner buffers less than its sm90 smem figure suggests; compiled
        on a CPU host in session 25), but to one wave per SIMD for down where "bits" at 2 stages has two (LDS-bound)
        and to 380 VGPRs + 124 AGPRs for gate + up; with no AMD GPU to time it, AMD keeps the tile it had."""
        del dtype
        if tile_m <= 16:
            return cls(decode="f16")
        return cls(decode="f16") if arch is not None and arch.startswith("sm") else cls(num_stages=2)
