"""Test-wide setup: CPU only, several virtual devices (so sharding code runs), deterministic seeds."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tiny test models run in microseconds; XLA's LLVM optimisation only costs compile time here.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
