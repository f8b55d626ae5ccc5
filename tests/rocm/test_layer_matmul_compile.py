"""The layer matmul (a scanned layer's bf16 dense linears read in their stacks) compiles for gfx942, gfx950 and
sm90 at Flash dims within each target's LDS / shared memory and without register spills (pip `triton`, no GPU).

Not part of the steps `tests/rocm/test_kernel_compile.py` lowers (those hold one layer of each kind, unscanned):
this lowers the kernel alone at decode, 8 rows: wq_b (1024 -> 32768, a stack of 20 layers as Flash's scanned
CSA / HCA pairs have), the shared expert's w2 (2048 -> 4096), and the grouped wo_a (8 groups, 4096 -> 1024).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from lone_kernel import compile_alone

from ds4jax.rocm_check.targets import TARGETS
from pallas_kernels.fp8_matmul import BlockSizes
from pallas_kernels.layer_matmul import layer_matmul

S = jax.ShapeDtypeStruct
LAYERS = 20
CASES = {"decode_wq_b": ((8, 1024), (LAYERS, 1024, 32768)), "decode_shared_w2": ((8, 2048), (LAYERS, 2048, 4096)),
         "decode_wo_a": ((8, 8, 4096), (LAYERS, 8, 4096, 1024))}


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_matmul_compiles_within_limits(case, target):
    x, stack = CASES[case]
    fn = lambda x, w, layer: layer_matmul(x, w, layer, block_sizes=BlockSizes.get_default(jnp.bfloat16, 8))  # noqa
    res = compile_alone(fn, (S(x, jnp.bfloat16), S(stack, jnp.bfloat16), S((), jnp.int32)), target)
    print(case, target, res)
