"""Input checks for the mHC pre-step (static: shapes, dtypes and parameters at trace time)."""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp

from pallas_kernels.sinkhorn.validate import MAX_M

_INT32_MAX = 2**31 - 1  # element offsets are int32 inside the kernel


def _finite_nonneg(name, v):
    if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be a finite float >= 0, got {v!r}")


def validate_mhc_pre_static(mix, x, scale, base, norm_weight, iters, hc_eps, rms_eps, head, layer=None) -> None:
    """Raise ValueError naming the offending argument. With `layer`, scale / base / norm_weight are stacks: one
    leading layer axis, the same depth for the three."""
    if x.ndim < 2:
        raise ValueError(f"x must be [..., m, e], got shape {x.shape}")
    m, e = x.shape[-2:]
    if not 1 <= m <= MAX_M:
        raise ValueError(f"x: m={m} streams must be in [1, {MAX_M}]")
    n = m if head else 2 * m + m * m
    if mix.shape != x.shape[:-2] + (n,):
        raise ValueError(f"mix must be {x.shape[:-2] + (n,)} (x's tokens, {'m' if head else '2m + m*m'} outputs), "
                         f"got {mix.shape}")
    lead = ()
    if layer is not None:
        if jnp.shape(layer) != () or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
            raise ValueError(f"layer must be an integer scalar, got shape {jnp.shape(layer)}")
        lead = scale.shape[:1]
        if not lead or lead[0] < 1 or base.shape[:1] != lead or norm_weight.shape[:1] != lead:
            raise ValueError(f"stacked scale / base / norm_weight must share a leading layer axis, got "
                             f"{scale.shape}, {base.shape}, {norm_weight.shape}")
        scale, base, norm_weight = (jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in (scale, base, norm_weight))
    if scale.shape != ((1,) if head else (3,)):
        raise ValueError(f"scale must be [{1 if head else 3}], got {scale.shape}")
    if base.shape != (n,):
        raise ValueError(f"base must be [{n}], got {base.shape}")
    if norm_weight.shape != (e,):
        raise ValueError(f"norm_weight must be [{e}] (x's hidden size), got {norm_weight.shape}")
    for name, a in (("mix", mix), ("x", x), ("scale", scale), ("base", base), ("norm_weight", norm_weight)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got {a.dtype}")
    if math.prod(x.shape) > _INT32_MAX:
        raise ValueError(f"x has {math.prod(x.shape)} elements: more than int32 offsets address")
    if not head and (not isinstance(iters, int) or isinstance(iters, bool) or iters < 1):
        raise ValueError(f"iters must be an int >= 1, got {iters!r}")
    _finite_nonneg("hc_eps", hc_eps)
    _finite_nonneg("rms_eps", rms_eps)
