"""Compile one Triton kernel with the pip `triton` wheel for a GPU target (no GPU needed) and read its resources.

AMD: the amdgcn assembly's kernel metadata (VGPR/AGPR/SGPR counts, spill counts, scratch = private segment bytes
per lane, the compiler's register-limited occupancy). NVIDIA: `cuobjdump --dump-resource-usage` of the cubin
(REG, LOCAL = spill bytes per thread). LDS / shared memory: Triton's `metadata.shared` (dynamic allocation, so the
assembly's static LDS size is 0).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import re
import subprocess
import tempfile

from ds4jax.rocm_check.extract import TritonKernel
from ds4jax.rocm_check.targets import GpuTarget

TRITON_VERSION = "3.6.0"  # pinned in pyproject (test extra): the report's register counts depend on it


class TritonUnavailable(RuntimeError):
    pass


def triton_backends() -> set[str]:
    """Backends the installed `triton` wheel carries ({"amd", "nvidia"} for the Linux wheels)."""
    try:
        from triton.backends import backends
    except ImportError as e:
        raise TritonUnavailable(f"pip triton is not installed ({e}); `pip install -e .[test]` brings it") from None
    return set(backends)


@dataclasses.dataclass(frozen=True)
class Resources:
    lds: int  # bytes of LDS / shared memory per workgroup
    vgprs: int  # AMD: architected VGPRs; NVIDIA: registers per thread
    agprs: int  # AMD accumulation registers (0 on NVIDIA)
    sgprs: int  # AMD scalar registers (0 on NVIDIA)
    spills: int  # AMD: VGPRs spilled to scratch memory; NVIDIA: spill (local memory) bytes per thread
    sgpr_spills: int  # AMD: SGPRs spilled (into VGPR lanes: cheap); 0 on NVIDIA
    scratch: int  # private (scratch / local) memory per lane, bytes
    occupancy: int  # waves per SIMD (AMD, of 8) / warps per SM (NVIDIA, of 64), registers and LDS both counted
    occupancy_limit: str  # what limits it: "registers", "LDS", "waves"


def _field(text: str, pattern: str) -> int:
    found = re.findall(pattern, text)
    if not found:
        raise ValueError(f"no {pattern!r} in the compiled kernel's metadata")
    return max(int(v) for v in found)


def _amd(num_warps: int, compiled, gpu: GpuTarget) -> Resources:
    asm = compiled.asm["amdgcn"]
    lds = compiled.metadata.shared
    vgprs, agprs = _field(asm, r"\.vgpr_count:\s+(\d+)"), _field(asm, r"\.agpr_count:\s+(\d+)")
    by_regs = _field(asm, r"; Occupancy: (\d+)")  # waves per SIMD the register budget allows
    groups = gpu.local_memory // lds if lds else 1 << 30  # workgroups per CU the LDS allows
    by_lds = groups * num_warps // gpu.units
    occ = min(by_regs, by_lds, gpu.max_waves)
    limit = "LDS" if occ == by_lds and by_lds < by_regs else ("registers" if occ < gpu.max_waves else "waves")
    return Resources(lds=lds, vgprs=vgprs, agprs=agprs, sgprs=_field(asm, r"\.sgpr_count:\s+(\d+)"),
                     spills=_field(asm, r"\.vgpr_spill_count:\s+(\d+)"),
                     sgpr_spills=_field(asm, r"\.sgpr_spill_count:\s+(\d+)"),
                     scratch=_field(asm, r"\.private_segment_fixed_size:\s+(\d+)"), occupancy=occ,
                     occupancy_limit=limit)


def on_cubin(tool: str, args: list[str], cubin: bytes) -> str:
    """The text output of one of the pip `triton` wheel's CUDA tools (`cuobjdump`, `nvdisasm`) run on `cubin`."""
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([path, *args, f.name], check=True, capture_output=True, text=True).stdout


def _nvidia(num_warps: int, compiled, gpu: GpuTarget) -> Resources:
    usage = on_cubin("cuobjdump", ["--dump-resource-usage"], compiled.asm["cubin"])
    regs, local = _field(usage, r"REG:(\d+)"), _field(usage, r"LOCAL:(\d+)")
    lds = compiled.metadata.shared
    warps = num_warps
    by_regs = gpu.registers // (((regs + 7) // 8 * 8) * gpu.wave * warps) * warps  # 8-register granularity
    by_lds = (228 * 1024 // (lds + 1024)) * warps if lds else 1 << 30  # 1 KB reserved per block
    occ = min(by_regs, by_lds, gpu.max_waves // warps * warps)
    limit = "LDS" if occ == by_lds and by_lds < by_regs else ("registers" if occ < gpu.max_waves else "waves")
    return Resources(lds=lds, vgprs=regs, agprs=0, sgprs=0, spills=local, sgpr_spills=0, scratch=local, occupancy=occ,
                     occupancy_limit=limit)


def kernel_key(kernel: TritonKernel, gpu: GpuTarget) -> str:
    """What a compile's result depends on: the Triton IR, the launch parameters, the target and the Triton version
    (the compiler is deterministic for these)."""
    text = "\0".join((TRITON_VERSION, gpu.name, str(kernel.num_warps), str(kernel.num_stages), kernel.ttir))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclasses.dataclass
class Recorded:
    """Resources a full compile recorded (`scripts/rocm_kernels.py` writes them into rocm_kernels.json), keyed by
    `kernel_key`; `misses`: the keys looked up and not found (compiled instead)."""

    resources: dict[str, Resources]
    misses: set[str] = dataclasses.field(default_factory=set)


_recorded: Recorded | None = None
compiled: dict[str, Resources] = {}  # every key this process compiled for real (the script records them all)


@contextlib.contextmanager
def recorded(resources: dict[str, dict]):
    """Within: a kernel whose key a full compile recorded takes the recorded resources instead of compiling again
    (Triton takes ~0.7 CPU s a kernel, two CPU minutes for the whole report); any other kernel compiles."""
    global _recorded
    book = Recorded({k: Resources(**v) for k, v in resources.items()})
    previous, _recorded = _recorded, book
    try:
        yield book
    finally:
        _recorded = previous


def compile_kernel(kernel: TritonKernel, gpu: GpuTarget, *, fresh: bool = False) -> Resources:
    """Compile `kernel` for `gpu` with its own num_warps / num_stages and read its resources (cached per process;
    Triton's on-disk cache also spares recompiling identical modules across processes). Inside `recorded(...)` a
    recorded key is not compiled again unless `fresh`."""
    key = kernel_key(kernel, gpu)
    if _recorded is not None and not fresh:
        if key in _recorded.resources:
            return _recorded.resources[key]
        _recorded.misses.add(key)
    res = _compile(kernel.name, kernel.ttir, kernel.num_warps, kernel.num_stages, gpu)
    compiled[key] = res
    return res


def compile_module(name: str, ttir: str, num_warps: int, num_stages: int, gpu: GpuTarget):
    """The pip `triton` wheel's compile of one Triton module (text IR) for `gpu`: its `CompiledKernel` (`.asm`
    holds the cubin / hsaco, `.metadata` the shared memory)."""
    import triton

    backend = "amd" if gpu.backend == "hip" else "nvidia"
    if backend not in triton_backends():
        raise TritonUnavailable(f"this triton wheel ({triton.__version__}) has no {backend} backend")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{name}.ttir")
        with open(path, "w") as f:
            f.write(ttir)
        return triton.compile(path, target=gpu.triton_target(), options=dict(num_warps=num_warps,
                                                                             num_stages=num_stages))


@functools.lru_cache(maxsize=None)
def _compile(name: str, ttir: str, num_warps: int, num_stages: int, gpu: GpuTarget) -> Resources:
    compiled = compile_module(name, ttir, num_warps, num_stages, gpu)
    return (_amd if gpu.backend == "hip" else _nvidia)(num_warps, compiled, gpu)


def violations(kernel: TritonKernel, res: Resources, gpu: GpuTarget) -> list[str]:
    """Why `kernel` cannot run on `gpu` as compiled (empty: it fits)."""
    out = []
    if res.lds > gpu.local_memory:
        out.append(f"{kernel.name}: {res.lds} B of LDS/shared memory > {gpu.local_memory} B on {gpu.name}")
    return out
