"""64-bit element offsets for every operand of more than 2^31 elements (a fix to Pallas' Triton lowering).

Pallas' Triton lowering (`jax._src.pallas.triton.lowering._compute_offsets_from_indices`, jax 0.10 and 0.11) indexes
an operand with 32-bit element offsets unless its size in *bytes* exceeds 2^32, and Triton sign-extends a 32-bit
offset (LLVM's getelementptr indices are signed). A one-byte operand (FP8, packed FP4, E8M0 scales) of more than
2 GiB and at most 4 GiB therefore has elements whose 32-bit offsets wrap negative: the lowered IR of such a read
shows the i32 offsets (tests/kernels/test_large_operands.py). With this module the same read of a 3 GiB operand
returns the right bytes on an H100 (jax 0.11.2, session 17; the read was not run there without it). Such operands
are ordinary here: three scanned Flash layers' FP4 gate weights, which the grouped kernels read merged in place
(ds4jax/model/layer_of.py), are 3 GiB; an FP8 KV pool can be any size.

`install()` wraps the lowering's function so that an operand of more than 2^31 elements is lowered as if its
elements were 8 bytes wide: the function then takes its own 64-bit branch (the dtype enters only that size test,
the offsets count elements). Operands of at most 2^31 elements keep their 32-bit offsets (and their code) unchanged.
When JAX fixes the test (or renames the function), `install` leaves it alone: `needed()` reads its source.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import jax.numpy as jnp

LIMIT = 2**31  # elements: the first offset a signed 32-bit integer cannot hold (an operand of LIMIT elements is fine)


def _lowering():
    import warnings

    with warnings.catch_warnings():  # the Triton backend warns as deprecated on jax >= 0.11
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax._src.pallas.triton import lowering
    return lowering


def needed(lowering=None) -> bool:
    """Whether the installed JAX's lowering decides offset width by bytes past 2^32 (the fault above)."""
    lowering = lowering or _lowering()
    fn = getattr(lowering, "_compute_offsets_from_indices", None)
    if fn is None or getattr(fn, "_ds4jax_wide_offsets", False):
        return False
    try:
        return "2**32" in inspect.getsource(fn)
    except (OSError, TypeError):
        return False


def install() -> bool:
    """Wrap the lowering's offset computation (idempotent); True when the wrapper is in place."""
    lowering = _lowering()
    fn = lowering._compute_offsets_from_indices
    if getattr(fn, "_ds4jax_wide_offsets", False):
        return True
    if not needed(lowering):
        return False

    @functools.wraps(fn)
    def offsets(block_info, nd_indexer):
        full = block_info.full_shape_dtype
        if math.prod(full.shape) > LIMIT and jnp.dtype(full.dtype).itemsize < 8:
            block_info = dataclasses.replace(block_info, full_shape_dtype=full.update(dtype=jnp.dtype(jnp.float64)))
        return fn(block_info, nd_indexer)

    offsets._ds4jax_wide_offsets = True
    lowering._compute_offsets_from_indices = offsets
    return True
