"""The one place that knows which Pallas GPU backend the kernels are lowered with.

Today: Pallas + Triton (`jax.experimental.pallas.triton`), the portable GPU path that also runs on ROCm.
JAX 0.11 deprecates it; a successor backend replaces the functions below and nothing else.

Why explicit Triton params: without them `pallas_call` on NVIDIA may pick Mosaic GPU (flag
`jax_pallas_use_mosaic_gpu`), which the kernels here are not written for.
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _wide_offsets

# Triton's `tt.dot` needs every matmul extent >= 16; interpret mode has no such limit.
TRITON_MIN_DOT_DIM = 16


def _triton():
    with warnings.catch_warnings():  # the module warns as deprecated on jax >= 0.11
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas import triton as pltriton
    return pltriton


def compiler_params(*, num_warps: int, num_stages: int, interpret: bool):
    """Backend compiler params for `pl.pallas_call` (None in interpret mode). Every kernel lowered for a GPU asks
    for them first, which installs the lowering's 64-bit offsets for operands past 2^31 elements (`_wide_offsets`)."""
    if interpret:
        return None
    _wide_offsets.install()
    return _triton().CompilerParams(num_warps=num_warps, num_stages=num_stages)


def gather_rows(ref, ids, valid):
    """ref [r, d], ids [n] i32, valid [n] bool -> [n, d]: ref[ids] where valid, else 0.

    A masked load: invalid slots are never read (they may hold -1 or point at NaN-poisoned rows), and
    Triton can still stream the rows into shared memory (cp.async with zero fill) for the matmuls.
    """
    n, d = ids.shape[0], ref.shape[1]
    # Both dims as index arrays (a row-id column and a column iota): the form that both the Triton
    # lowering and the interpreter's masked-load rule accept.
    rows = jnp.where(valid, ids, 0)[:, None]  # [n, 1]
    cols = lax.broadcasted_iota(jnp.int32, (1, d), 1)  # [1, d]
    # an FP8 pool's fill must already have its type: Triton's lowering has no int -> f8 conversion
    other = jnp.zeros((), ref.dtype) if jnp.issubdtype(ref.dtype, jnp.floating) and ref.dtype.itemsize == 1 else 0
    return _triton().load(ref.at[rows, cols], mask=jnp.broadcast_to(valid[:, None], (n, d)), other=other)


def load_at(ref, indices, valid):
    """ref[indices] where valid, else 0: `indices` one int32 index array per dim of ref (broadcastable to valid's
    shape, in range wherever valid is false too: the interpreter gathers every lane), a masked gather."""
    other = jnp.zeros((), ref.dtype)
    return _triton().load(ref.at[tuple(indices)], mask=valid, other=other)


def load_1d(ref, pos, valid, other):
    """ref [n], pos [...] i32, valid [...] bool -> ref[pos] where valid, else `other` (invalid slots never read)."""
    return _triton().load(ref.at[jnp.where(valid, pos, 0)], mask=valid, other=other)


def store_1d(ref, pos, val, valid):
    """Scatter ref[pos] = val where valid (a masked store: invalid slots write nothing).

    Invalid lanes get an out-of-range position: a GPU never touches it (masked), and interpret mode,
    which lowers the store to an XLA scatter, drops it, so it cannot collide with a valid lane.
    """
    _triton().store(ref.at[jnp.where(valid, pos, ref.shape[0])], val, mask=valid)


def load_range(ref, start, n, valid, other):
    """ref [m], start i32, valid [n] bool -> ref[start : start + n] where valid, else `other` (invalid slots never
    read; the range may run past the end of ref where those slots are invalid).

    For consecutive positions prefer this to `load_1d`: the interpreter reads a dynamic slice instead of an XLA
    gather, and Triton sees contiguous offsets (vector loads; `load_1d`'s where() on the offsets hides that)."""
    return _triton().load(ref.at[pl.ds(start, n)], mask=valid, other=other)


def store_range(ref, start, val, valid):
    """ref[start : start + n] = val where valid (a masked store of consecutive slots; invalid slots, and any past
    the end of ref, are not written). The interpreter writes a dynamic slice, where `store_1d` costs an XLA
    scatter (XLA:CPU: a while loop, ~0.05 s of compile each)."""
    _triton().store(ref.at[pl.ds(start, val.shape[0])], val, mask=valid)


def min_dot_dim(interpret: bool) -> int:
    """Smallest M/N/K a kernel may feed to a matmul on this backend."""
    return 1 if interpret else TRITON_MIN_DOT_DIM


def dot_precision(dtype) -> lax.Precision:
    """f32 inputs: force IEEE f32 (Triton's DEFAULT means TF32); bf16: native MMA."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT




def _tile_mask(starts, shape, bounds):
    """[*shape] bool: element (i, j) of the tile at `starts` lies inside `bounds` (None = that dim needs no mask);
    None when no dim needs one."""
    mask = None
    for axis, (start, size, bound) in enumerate(zip(starts, shape, bounds)):
        if bound is None:
            continue
        inside = start + lax.broadcasted_iota(jnp.int32, shape, axis) < bound
        mask = inside if mask is None else mask & inside
    return mask


def load_tile(ref, starts, shape, bounds, lead=()):
    """ref[*lead, s0 : s0 + shape[0], s1 : s1 + shape[1], ...] of a (len(lead) + len(shape))-d ref, with the elements at or past
    `bounds` (per dim, an int, or None where the tile never crosses the edge) never read: they load as 0 (masked
    load; Triton can still stream the tile into shared memory with zero fill). `lead`: scalar indices of the
    leading dims (an expert of an [experts, k, n] weight), in the same indexer: the Triton lowering takes one."""
    index = ref.at[(*lead, *(pl.ds(s, n) for s, n in zip(starts, shape)))]
    mask = _tile_mask(starts, shape, bounds)
    if mask is None:
        return index[...]
    # an FP8 fill must already have its type: Triton's lowering has no int -> f8 conversion
    return _triton().load(index, mask=mask, other=jnp.zeros((), ref.dtype))


def store_tile(ref, starts, val, bounds):
    """ref[s0 : s0 + n0, ...] = val for the elements inside `bounds` (as in `load_tile`); the others are not
    written (masked store)."""
    index = ref.at[tuple(pl.ds(s, n) for s, n in zip(starts, val.shape))]
    mask = _tile_mask(starts, val.shape, bounds)
    if mask is None:
        index[...] = val
    else:
        _triton().store(index, val, mask=mask)
