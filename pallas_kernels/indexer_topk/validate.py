"""Input checks for indexer top-k: static (shapes/dtypes, at trace time) and dynamic (values, tests/debug)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels._fp8 import check_pool_dtype

_FLOATS = (jnp.bfloat16, jnp.float32)


def validate_indexer_topk_static(q, w, keys, key_rows, n_valid, *, k, key_scale=None) -> None:
    """Raise ValueError naming the offending argument."""
    if q.ndim != 3:
        raise ValueError(f"q must be [t, hi, di], got shape {q.shape}")
    t, h, d = q.shape
    if q.dtype not in _FLOATS:
        raise ValueError(f"q must be bf16 or f32, got {q.dtype}")
    if w.shape != (t, h) or w.dtype != jnp.float32:
        raise ValueError(f"w must be f32 [t={t}, hi={h}], got {w.dtype} {w.shape}")
    if keys.ndim != 2 or keys.shape[1] != d:
        raise ValueError(f"keys must be [rows, di={d}], got shape {keys.shape}")
    check_pool_dtype("keys", keys, key_scale, q.dtype, scale_name="key_scale")
    if key_rows.ndim != 2 or key_rows.shape[0] != t or key_rows.dtype != jnp.int32:
        raise ValueError(f"key_rows must be int32 [t={t}, c], got {key_rows.dtype} {key_rows.shape}")
    if n_valid.shape != (t,) or n_valid.dtype != jnp.int32:
        raise ValueError(f"n_valid must be int32 [t={t}], got {n_valid.dtype} {n_valid.shape}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive Python int (static), got {k!r}")


def validate_indexer_topk_dynamic(q, w, keys, key_rows, n_valid, *, k, key_scale=None) -> None:
    """Value checks (host sync; for tests and debugging): 0 <= n_valid <= c; visible rows inside the pool."""
    validate_indexer_topk_static(q, w, keys, key_rows, n_valid, k=k, key_scale=key_scale)
    c = key_rows.shape[1]
    n_valid = np.asarray(n_valid)
    if n_valid.size and (n_valid.min() < 0 or n_valid.max() > c):
        raise ValueError(f"n_valid values must be in [0, c={c}], got range [{n_valid.min()}, {n_valid.max()}]")
    rows = np.asarray(key_rows)[np.arange(c)[None, :] < n_valid[:, None]]
    if rows.size and (rows.min() < 0 or rows.max() >= keys.shape[0]):
        raise ValueError(
            f"key_rows of visible entries must be in [0, {keys.shape[0]}), got range [{rows.min()}, {rows.max()}]"
        )
