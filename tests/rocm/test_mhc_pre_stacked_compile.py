"""The mHC pre-step with its small operands read in their stacks (a scanned layer's `layer` form) compiles for
gfx942, gfx950 and sm90 at Flash dims within each target's LDS / shared memory and without register spills (pip
`triton`, no GPU). The unstacked form is in the steps `tests/rocm/test_kernel_compile.py` lowers; scanned layers
are not (those steps hold one layer of each kind).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from lone_kernel import compile_alone

from ds4jax.model.config import flash
from ds4jax.rocm_check.targets import TARGETS
from pallas_kernels.mhc_pre import mhc_pre

S = jax.ShapeDtypeStruct
LAYERS = 20  # Flash's scanned (CSA, HCA) pairs: 20 repetitions of each member


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("rows", [1, 8])
def test_stacked_mhc_pre_compiles_within_limits(rows, target):
    cfg = flash()
    m, e = cfg.hc_mult, cfg.hidden_size
    n = (2 + m) * m
    fn = lambda layer, mix, x, scale, base, w: mhc_pre(  # noqa: E731
        mix, x, scale, base, w, layer=layer, iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, rms_eps=cfg.rms_norm_eps)
    args = (S((), jnp.int32), S((rows, n), jnp.float32), S((rows, m, e), jnp.bfloat16), S((LAYERS, 3), jnp.float32),
            S((LAYERS, n), jnp.float32), S((LAYERS, e), jnp.float32))
    print(rows, target, compile_alone(fn, args, target))
