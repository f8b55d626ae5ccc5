"""ROCm readiness checked on a CPU host: lower the real steps for a GPU target, pull out every Triton kernel
Pallas emitted, compile each with the pip `triton` wheel for MI300 (gfx942), MI355 (gfx950) and H200 (sm90), and
report what each costs (LDS/shared memory, registers, spills, occupancy).

`python scripts/rocm_kernels.py` writes `docs/benchmarks/rocm_kernels.md`; `tests/rocm/` checks the limits.
"""
