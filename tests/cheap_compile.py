"""XLA:CPU settings for the test processes: the suite's programs run for microseconds, so compiling them is the cost.

Every process the suite starts (the pytest workers, the mesh and checkpoint workers, the batch subprocess, the
notebook kernels) takes these flags, so that programs compiled in one of them can be found by another in the run's
shared compilation cache (conftest.py): the flags are part of the cache key.

Measured on the 2-core CI machine (backend compile seconds of one default-model speculative test, 14.7 s with
the level-0 flag alone): `--xla_cpu_use_fusion_emitters=false` -> 11.1 s (XLA:CPU's MLIR fusion emitters cost more
to build than the loop emitters they replace); `--xla_llvm_disable_expensive_passes=true` changes nothing at
level 0 but keeps the notebooks' earlier setting (scripts/notebook_tools.py).
"""

FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
         "--xla_llvm_disable_expensive_passes=true")


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a test process, with `devices` forced host devices when given."""
    forced = [f"--xla_force_host_platform_device_count={devices}"] if devices else []
    return " ".join(forced + list(FLAGS))
