"""XLA:CPU settings for the test processes: the suite's programs run for microseconds, so compiling them is the cost.

Every process the suite starts (the pytest workers, the mesh and checkpoint workers, the batch subprocess, the
notebook kernels) takes these flags, so that programs compiled in one of them can be found by another in the run's
shared compilation cache (conftest.py): the flags are part of the cache key.

Measured on the 2-core CI machine (backend compile seconds of one default-model speculative test, 14.7 s with
the level-0 flag alone): `--xla_cpu_use_fusion_emitters=false` -> 11.1 s (XLA:CPU's MLIR fusion emitters cost more
to build than the loop emitters they replace); `--xla_llvm_disable_expensive_passes=true` changes nothing at
level 0 but keeps the notebooks' earlier setting (scripts/notebook_tools.py).
`--xla_cpu_use_thunk_runtime=false` is a no-op in jaxlib 0.10.2 (XLA warns it is no longer supported; session 29
timed it at -11 % on two files and +12 % on the suite: this machine's noise).
`--xla_cpu_parallel_codegen_split_count=1`: XLA:CPU splits each program's LLVM module into up to 32 parts compiled
on threads; on the 2-core machine, with two pytest workers already using both cores, the split only adds work.
One part: the default model's engine warm-up (k = 2, one row bucket, 4 programs, `DS4JAX_COMPILE_THREADS=1`)
took 12.6-12.9 CPU s instead of 14.1-14.8 (three runs each, alternating), the same tokens.
`--xla_disable_hlo_passes=hlo-verifier`: XLA runs its HLO verifier after every pass of its pipelines as an
invariant check; sampled with `perf` while compiling the tiny model's decode, prefill and verify steps it was 8 % of
the compile (the whole HLO-pass share went 30.7 -> 27.6 % with it off), and the best of six compiles of the decode
and prefill steps took 2.28-2.33 CPU s against 2.36-2.89 with it (this machine's noise is about that large). It
checks XLA's own rewrites, not ours: a program the suite builds wrongly still fails in JAX's lowering or in the
first pass that meets it.

`relax_gc()`: Python collects its youngest generation every 700 net allocations. Tracing and lowering allocate
millions of short-lived objects, so a test process spent 11.3 of 141 CPU s in the collector
(tests/test_engine.py + test_speculative.py in one process, timed with `gc.callbacks`: 3,067 young and 279 middle
collections); with the thresholds below, 3.2 s (30 and 1: the rest are explicit `gc.collect()` calls). Cycles
live longer between collections; the suite's arrays are small.
"""

import gc
import importlib.metadata


def _jaxlib_before(major: int, minor: int) -> bool:
    """Whether the installed jaxlib is older than major.minor (read without importing JAX, which would parse
    XLA_FLAGS at once)."""
    try:
        version = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return True
    parts = [int(p) for p in version.split(".")[:2] if p.isdigit()]
    return tuple(parts) < (major, minor)


# XLA aborts the process on a flag it does not know, before pytest can print a line: jaxlib 0.11's XLA dropped
# the loop-emitter switch (the fusion emitters are its only path), so the H200 image's pytest died at start-up
FLAGS = ("--xla_backend_optimization_level=0",
         *(("--xla_cpu_use_fusion_emitters=false",) if _jaxlib_before(0, 11) else ()),
         "--xla_llvm_disable_expensive_passes=true",
         "--xla_cpu_parallel_codegen_split_count=1",
         "--xla_disable_hlo_passes=hlo-verifier")
GC_THRESHOLDS = (50_000, 20, 100)


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a test process, with `devices` forced host devices when given."""
    forced = [f"--xla_force_host_platform_device_count={devices}"] if devices else []
    return " ".join(forced + list(FLAGS))


def relax_gc() -> None:
    """Collect garbage less often in a test process (see the module docstring)."""
    gc.set_threshold(*GC_THRESHOLDS)
