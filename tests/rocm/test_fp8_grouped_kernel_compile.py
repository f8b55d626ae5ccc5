"""The FP8 grouped matmul (routed experts reading block-scaled E4M3 as stored) compiles for gfx942, gfx950 and sm90
at Flash dims within each target's LDS / shared memory and without register spills (pip `triton`, no GPU).

The kernel alone with the value format each target stores (FNUZ on gfx942), default blocks: decode (6 one-row
tiles of 16) and prefill (448 tiles of 64 rows), gate + up (4096 -> 2048) and down (2048 -> 4096), bf16
activations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from lone_kernel import compile_alone

from ds4jax.rocm_check.targets import TARGETS
from pallas_kernels.grouped_matmul_fp8 import grouped_matmul_fp8

S = jax.ShapeDtypeStruct


def _args(rows, tiles, n_w, k, n, fp8_dtype):
    w = lambda: (S((256, k, n), fp8_dtype), S((256, -(-k // 128), -(-n // 128)), jnp.float32))
    return S((rows, k), jnp.bfloat16), tuple(w() for _ in range(n_w)), S((tiles,), jnp.int32)


CASES = {"decode_gate_up": (96, 6, 2, 4096, 2048), "decode_down": (96, 6, 1, 2048, 4096),
         "prefill_gate_up": (448 * 64, 448, 2, 4096, 2048), "prefill_down": (448 * 64, 448, 1, 2048, 4096)}


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_fp8_grouped_kernel_compiles_within_limits(case, target):
    res = compile_alone(grouped_matmul_fp8, _args(*CASES[case], TARGETS[target].target.fp8_dtype), target)
    print(case, target, res)
