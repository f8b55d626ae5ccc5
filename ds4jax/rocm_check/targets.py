"""The GPU targets the kernels are checked for, with the per-CU / per-SM limits that decide fit and occupancy."""

from __future__ import annotations

import dataclasses

from ds4jax.runtime.target import Target


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """name: the architecture ("gfx942"). lowering: the JAX platform whose Pallas lowering feeds it.
    local_memory: LDS per CU (AMD) / shared memory per block (NVIDIA), bytes: the limit a kernel must fit.
    wave: lanes per wavefront / warp. units: SIMDs per CU (AMD) / 1 SM (NVIDIA); max_waves: per unit."""

    name: str
    product: str
    lowering: str
    local_memory: int
    wave: int
    units: int
    max_waves: int
    registers: int  # AMD: VGPRs per lane per SIMD (VGPR + AGPR file); NVIDIA: 32-bit registers per SM

    @property
    def backend(self) -> str:
        return "hip" if self.lowering == "rocm" else "cuda"

    @property
    def target(self) -> Target:
        return Target(self.lowering, self.name)

    def triton_target(self):
        from triton.backends.compiler import GPUTarget

        arch = self.name if self.backend == "hip" else int(self.name.removeprefix("sm"))
        return GPUTarget(self.backend, arch, self.wave)


# CDNA3 / CDNA4: 4 SIMDs per CU, at most 8 waves per SIMD, 512 registers per lane (256 VGPR + 256 AGPR).
GFX942 = GpuTarget("gfx942", "MI300X / MI325X", "rocm", 64 * 1024, 64, 4, 8, 512)
GFX950 = GpuTarget("gfx950", "MI355X", "rocm", 160 * 1024, 64, 4, 8, 512)
# Hopper: 227 KB of shared memory per block, 64 warps and 64k registers per SM.
SM90 = GpuTarget("sm90", "H100 / H200", "cuda", 227 * 1024, 32, 1, 64, 65536)

TARGETS = {t.name: t for t in (GFX942, GFX950, SM90)}
