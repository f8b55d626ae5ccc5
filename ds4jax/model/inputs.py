"""Host-side checks of what callers hand the model: token ids, lengths, chunk sizes, sampling values.

JAX clamps out-of-bounds gathers and drops out-of-bounds scatters silently, so an id outside the vocabulary would
give finite, wrong logits. Every check here runs on the host before anything is traced or written and raises
`ArgumentError` naming the argument, the position and the value.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from ds4jax.errors import ArgumentError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def check_int(value: Any, name: str, *, low: int | None = None, high: int | None = None) -> int:
    """An integer in [low, high] (either end optional); numpy integers are accepted."""
    if not is_int(value):
        raise ArgumentError("must be an integer", name=name, value=value)
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        span = f"[{'-inf' if low is None else low}, {'inf' if high is None else high}]"
        raise ArgumentError(f"must be in {span}", name=name, value=value)
    return value


def check_real(value: Any, name: str) -> float:
    """A finite real number (int or float, not bool)."""
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)) or not math.isfinite(value):
        raise ArgumentError("must be a finite number", name=name, value=value)
    return float(value)


def check_token_ids(ids: Any, vocab_size: int, name: str = "token_ids") -> np.ndarray:
    """A non-empty integer array of ids in [0, vocab_size), as int32 on the host (any rank)."""
    try:
        arr = np.asarray(ids)
    except Exception as e:  # ragged nested lists, objects numpy cannot hold
        raise ArgumentError(f"must be an array of token ids ({type(e).__name__})", name=name,
                            value=type(ids).__name__) from None
    if arr.size == 0:
        raise ArgumentError("is empty: at least one token is needed", name=name, value=arr.shape)
    if arr.dtype == object or not np.issubdtype(arr.dtype, np.integer):
        if arr.dtype != object and np.issubdtype(arr.dtype, np.floating) and np.array_equal(arr, np.round(arr)):
            hint = " (cast to int32: ids must not be floats)"
        else:
            hint = ""
        raise ArgumentError(f"must be integer token ids{hint}", name=name, value=str(arr.dtype))
    bad = (arr < 0) | (arr >= vocab_size)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ArgumentError(f"token id {int(arr[where])} at position {list(where)} is outside the vocabulary "
                            f"[0, {vocab_size})", name=name, value=int(arr[where]))
    return arr.astype(np.int32)
