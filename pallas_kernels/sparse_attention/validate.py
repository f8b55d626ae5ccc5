"""Input checks for sparse attention: static (shapes/dtypes, at trace time) and dynamic (values, tests/debug)."""

from __future__ import annotations

import numbers

import jax.numpy as jnp
import numpy as np

from pallas_kernels._fp8 import check_pool_dtype

_FLOATS = (jnp.bfloat16, jnp.float32)


def validate_sparse_attention_static(q, kv_a, idx_a, kv_b, idx_b, sink, *, scale, kv_a_scale=None,
                                     kv_b_scale=None, a_base=None) -> None:
    """Raise ValueError naming the offending argument."""
    if a_base is not None and (jnp.shape(a_base) != () or not jnp.issubdtype(jnp.result_type(a_base), jnp.integer)):
        raise ValueError(f"a_base must be an integer scalar, got {a_base!r}")
    if q.ndim != 3:
        raise ValueError(f"q must be [t, h, d], got shape {q.shape}")
    t, h, d = q.shape
    if q.dtype not in _FLOATS:
        raise ValueError(f"q must be bf16 or f32, got {q.dtype}")
    for name, kv, kv_scale in (("kv_a", kv_a, kv_a_scale), ("kv_b", kv_b, kv_b_scale)):
        if kv.ndim != 2 or kv.shape[1] != d:
            raise ValueError(f"{name} must be [rows, d={d}], got shape {kv.shape}")
        check_pool_dtype(name, kv, kv_scale, q.dtype)
    for name, idx in (("idx_a", idx_a), ("idx_b", idx_b)):
        if idx.ndim != 2 or idx.shape[0] != t:
            raise ValueError(f"{name} must be [t={t}, n], got shape {idx.shape}")
        if idx.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {idx.dtype}")
    if sink.shape != (h,):
        raise ValueError(f"sink must be [h={h}], got shape {sink.shape}")
    if sink.dtype != jnp.float32:
        raise ValueError(f"sink must be f32, got {sink.dtype}")
    if not isinstance(scale, numbers.Real) or not np.isfinite(scale):
        raise ValueError(f"scale must be a finite real number (static), got {scale!r}")


def validate_sparse_attention_dynamic(q, kv_a, idx_a, kv_b, idx_b, sink, *, scale, kv_a_scale=None,
                                      kv_b_scale=None, a_base=None) -> None:
    """Value checks (host sync; for tests and debugging): every index is -1 or a row of its pool (list A's
    counted from a_base)."""
    validate_sparse_attention_static(q, kv_a, idx_a, kv_b, idx_b, sink, scale=scale, kv_a_scale=kv_a_scale,
                                     kv_b_scale=kv_b_scale, a_base=a_base)
    if a_base is not None:
        idx_a = np.where(np.asarray(idx_a) >= 0, np.asarray(idx_a) + int(a_base), -1)
    for name, idx, rows in (("idx_a", idx_a, kv_a.shape[0]), ("idx_b", idx_b, kv_b.shape[0])):
        idx = np.asarray(idx)
        if idx.size and (idx.min() < -1 or idx.max() >= rows):
            raise ValueError(f"{name} values must be -1 or in [0, {rows}), got range [{idx.min()}, {idx.max()}]")

