"""The accelerator the kernels are compiled for: platform and architecture of the local device.

Kernel tile defaults differ per architecture (`pallas_kernels.*.BlockSizes.get_default(dtype, arch=...)`):
an AMD wavefront is 64 lanes (an NVIDIA warp 32), MI300's LDS is 64 KB per CU, MI355's 160 KB (an H200 SM has
227 KB of shared memory). `docs/benchmarks/rocm_kernels.md` reports what each tile costs on each target.

The device never changes within a process, so the kernel dispatcher reads it at trace time. Lowering for another
target on this host (`ds4jax.rocm_check`) patches `device_target` and clears JAX's trace caches.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

FNUZ_ARCHS = ("gfx940", "gfx941", "gfx942")  # MI300: FP8 in the FNUZ formats only


@dataclasses.dataclass(frozen=True)
class Target:
    """platform: "cuda" / "rocm" / "cpu" / "tpu". arch: "sm90", "gfx942", "gfx950", ... (None off GPUs)."""

    platform: str
    arch: str | None = None

    @property
    def fp8_dtype(self) -> Any:
        """The FP8 E4M3 variant this device computes with: MI300 (gfx940-942) has only the FNUZ formats
        (exponent bias 8, no negative zero); MI355 (gfx950), NVIDIA and the CPU use OCP float8_e4m3fn.
        Quantized weights are stored in it on the device (`ds4jax.io.quantized_load`)."""
        fnuz = self.platform == "rocm" and (self.arch or "") in FNUZ_ARCHS
        return jnp.float8_e4m3fnuz if fnuz else jnp.float8_e4m3fn

    @property
    def keeps_checkpoint_formats(self) -> bool:
        """Whether `ds4jax.load` keeps FP8 / FP4 weights as stored by default (GPUs; a CPU dequantizes)."""
        return self.platform in ("cuda", "rocm")


def target_of(device) -> Target:
    """Platform and architecture of a JAX device.

    JAX reports both GPU kinds as platform "gpu"; the client's platform version names the runtime ("rocm ..." or
    "cuda ..."). compute_capability is "9.0" on NVIDIA and the gcnArchName ("gfx942:sramecc+:xnack-") on AMD.
    """
    platform = device.platform
    if platform in ("gpu", "cuda", "rocm"):
        version = str(getattr(device.client, "platform_version", "")).lower()
        cc = str(getattr(device, "compute_capability", "") or "")
        if platform == "rocm" or "rocm" in version or "hip" in version or cc.startswith("gfx"):
            return Target("rocm", cc.split(":")[0] or None)
        return Target("cuda", "sm" + cc.replace(".", "") if cc else None)
    return Target(platform)


def device_target() -> Target:
    """The target of the default device (the one jitted steps run on)."""
    return target_of(jax.devices()[0])
