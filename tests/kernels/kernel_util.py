"""Shared helpers for kernel tests: backend detection, paged row maps, NaN poisoning."""

from __future__ import annotations

import jax
import numpy as np


def has_gpu() -> bool:
    """A GPU is visible to JAX (conftest initialises it next to the default CPU backend when present)."""
    for platform in ("cuda", "rocm", "gpu"):
        try:
            if jax.devices(platform):
                return True
        except RuntimeError:
            continue
    return False


def paged_rows(rng: np.random.Generator, n_entries: int, page: int, free_pages: list[int]) -> np.ndarray:
    """Row of each logical entry 0..n_entries-1 under a random page table drawn from `free_pages`
    (consumed), so consecutive entries cross page boundaries like a real pool."""
    n_pages = -(-n_entries // page)
    table = [free_pages.pop(rng.integers(len(free_pages))) for _ in range(n_pages)]
    j = np.arange(n_entries)
    return (np.asarray(table, np.int64)[j // page] * page + j % page).astype(np.int32)


def poison_unused(pool: np.ndarray, used_rows: np.ndarray) -> np.ndarray:
    """NaN in every pool row not in `used_rows`: reading one poisons the result."""
    out = np.full_like(pool, np.nan)
    used = np.unique(used_rows[used_rows >= 0])
    out[used] = pool[used]
    return out


def stack_with_poison(a, layer: int, layers: int):
    """`a` as layer `layer` of a [layers, ...] stack whose other layers are NaN: a kernel that reads a stacked
    operand at the wrong layer poisons its result."""
    import jax.numpy as jnp

    return jnp.full((layers,) + a.shape, jnp.nan, a.dtype).at[layer].set(a)


FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e4m3fnuz": 240.0}


def quantize_rows(pool, fmt: str):
    """An FP8 pool as the KV cache stores it, made with ml_dtypes (independent of ds4jax): per row,
    scale = max |x| / FP8_MAX[fmt] (1 for an all-zero row) and values round(x / scale) in `fmt`. A NaN row (poison)
    gets NaN values and a NaN scale. Returns (jnp values, jnp f32 scales)."""
    import jax.numpy as jnp
    import ml_dtypes

    pool = np.asarray(pool, np.float32)
    amax = np.abs(pool).max(axis=-1)
    scale = np.where(amax > 0, amax / FP8_MAX[fmt], 1.0).astype(np.float32)
    with np.errstate(invalid="ignore"):
        values = (pool / scale[:, None]).astype(getattr(ml_dtypes, fmt))
    return jnp.asarray(values), jnp.asarray(scale)
