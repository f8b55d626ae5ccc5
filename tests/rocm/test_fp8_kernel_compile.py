"""The FP8 dense matmul (block-scaled E4M3 linears read as stored) compiles for gfx942, gfx950 and sm90 at Flash
dims within each target's LDS / shared memory and without register spills (pip `triton`, no GPU).

Not part of the steps `tests/rocm/test_kernel_compile.py` lowers (those take bf16 params); this lowers the kernel
alone with the value format each target stores (FNUZ on gfx942): decode (8 rows, wq_a 4096 -> 1024 and wq_b
1024 -> 32768) and a 512-token prefill chunk (wo_b 8192 -> 4096), bf16 activations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from lone_kernel import compile_alone

from ds4jax.rocm_check.targets import TARGETS
from pallas_kernels.fp8_matmul import fp8_matmul

S = jax.ShapeDtypeStruct
CASES = {"decode_wq_a": (8, 4096, 1024), "decode_wq_b": (8, 1024, 32768), "prefill_wo_b": (512, 8192, 4096)}


def _args(m, k, n, fp8_dtype):
    return S((m, k), jnp.bfloat16), S((k, n), fp8_dtype), S((-(-k // 128), -(-n // 128)), jnp.float32)


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_fp8_kernel_compiles_within_limits(case, target):
    res = compile_alone(fp8_matmul, _args(*CASES[case], TARGETS[target].target.fp8_dtype), target)
    print(case, target, res)
