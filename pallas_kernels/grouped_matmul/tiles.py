"""What every grouped-matmul kernel over expert-sorted row tiles shares, whatever its weight format: a program
either accumulates its tile's k range for the tile's group or, for an empty tile (group -1), writes zeros and
reads no weight; and each k split writes its own partial output, summed after the call."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


def _assign(o_ref, val) -> None:
    o_ref[...] = val


def write_tile(group, o_refs, steps: int, body: Callable, *, shape: tuple[int, int] | None = None,
               store: Callable = _assign) -> None:
    """o_refs[w] = the f32 accumulators of `steps` iterations of `body(i, accs)` when `group` >= 0, else zeros.

    `shape`: the accumulators' [tile_m, block_n] (default: the out refs' shape, a blocked output); `store(o_ref,
    val)` writes one (default: the whole ref; a kernel with whole output refs stores its tile there itself)."""
    tile_m, block_n = shape or o_refs[0].shape
    zeros = lambda: tuple(jnp.zeros((tile_m, block_n), jnp.float32) for _ in o_refs)

    @pl.when(group >= 0)
    def _():  # a static trip count: Triton software-pipelines the weight loads
        for o, acc in zip(o_refs, lax.fori_loop(0, steps, body, zeros())):
            store(o, acc)

    @pl.when(group < 0)
    def _():  # an empty tile reads no weight
        for o, z in zip(o_refs, zeros()):
            store(o, z)


def split_outputs(n_w: int, *, k_splits: int, rows: int, tile_m: int, n: int, block_n: int):
    """(out_specs, out_shape) of a grid (tile, column block, k split): one [k_splits, rows, n] f32 per weight."""
    specs = [pl.BlockSpec((None, tile_m, block_n), lambda t, j, s: (s, t, j)) for _ in range(n_w)]
    shapes = [jax.ShapeDtypeStruct((k_splits, rows, n), jnp.float32) for _ in range(n_w)]
    return specs, shapes


def sum_splits(outs) -> tuple:
    """The outputs of `split_outputs` with their k splits summed: [rows, n] f32 each."""
    return tuple(o[0] if o.shape[0] == 1 else jnp.sum(o, axis=0) for o in outs)
