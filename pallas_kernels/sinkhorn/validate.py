"""Input checks for the Sinkhorn projection (static: shapes, dtypes and parameters at trace time)."""

from __future__ import annotations

import math
import numbers

import jax.numpy as jnp

# Each token's m * m values live in registers across the iterations (m = 4 in DeepSeek-V4: 16 per token).
MAX_M = 16
_INT32_MAX = 2**31 - 1  # flat element offsets are int32 inside the kernel


def validate_sinkhorn_static(logits, iters, eps) -> None:
    """Raise ValueError naming the offending argument."""
    if logits.ndim < 2 or logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"logits must be [..., m, m], got shape {logits.shape}")
    m = logits.shape[-1]
    if not 1 <= m <= MAX_M:
        raise ValueError(f"logits: m={m} must be in [1, {MAX_M}] (each token's m*m values stay in registers)")
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if math.prod(logits.shape) > _INT32_MAX:
        raise ValueError(f"logits has {math.prod(logits.shape)} elements: more than int32 offsets address")
    if not isinstance(iters, int) or isinstance(iters, bool) or iters < 1:
        raise ValueError(f"iters must be an int >= 1, got {iters!r}")
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}")
