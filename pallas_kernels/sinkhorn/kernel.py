"""Sinkhorn projection — portable Pallas kernel (Triton backend; interpret mode on CPU).

The whole projection (softmax, then `iters` column and iters - 1 row normalisations) in one launch. As an XLA
loop on a GPU every iteration is a few tiny kernel launches (twice per decoder layer); unrolled, XLA's GPU
compiler takes minutes over a decode loop. Program p takes `block` consecutive tokens as one [block, m, m] tile:
one masked, contiguous load (the tail block's missing tokens are never read, never written), the row and column
sums as reductions over the tile's last two axes, the iterations an in-kernel loop (scf.for), one masked store.
An m that is not a power of two (Triton extents are) is padded to one, masked: padding is never read or written
and stays 0 through the sums.

Why a tile and not the m*m per-element [block] vectors of the first version (16 1-D gathers and 16 scatters on
the flat array, elementwise m-term sums): the Pallas interpreter turns each 1-D masked access into an XLA
gather or scatter on the whole array (XLA:CPU expands every scatter into a while loop) and each of the ~400
vector ops into its own HLO op, which cost ~0.3 s of XLA:CPU compile per call site in every CPU test of a whole
model; the tile is a dynamic slice, one update and ~10 ops. On the GPU (pip triton 3.6, m = 4): a prefill block
(128 tokens, 4 warps) still gets each token's 16 values in one thread (sm90: no shuffle, the same 171
instructions per iteration) and now loads and stores them as 4 x 128-bit accesses instead of 16 strided 32-bit
gathers and scatters; a decode block of 8 tokens (1 warp) spreads a token over 4 lanes: 76 instructions per
iteration with 8 shuffles (column sums) instead of 175.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend
from pallas_kernels._util import cdiv, edge_bound, next_pow2
from pallas_kernels.sinkhorn.blocks import BlockSizes, launch_block
from pallas_kernels.sinkhorn.validate import validate_sinkhorn_static


def project_tile(x, *, m: int, iters: int, eps: float):
    """The projection of a [block, mp, mp] f32 tile of logits (mp = next_pow2(m); entries past m are padding,
    whatever they hold) -> [block, mp, mp] f32, padding 0. Shared with the fused mHC kernel (`mhc_pre`)."""
    mp = x.shape[-1]
    keep = lambda c: c  # noqa: E731
    if mp != m:  # padded logits: -inf (softmax 0) in a real row, and 0 through the normalisations
        i = lax.broadcasted_iota(jnp.int32, x.shape, 1)
        j = lax.broadcasted_iota(jnp.int32, x.shape, 2)
        real = (i < m) & (j < m)
        x = jnp.where(j < m, x, -jnp.inf)
        keep = lambda c: jnp.where(real, c, 0.0)  # noqa: E731
    rows = lambda c: jnp.sum(c, axis=2, keepdims=True)  # noqa: E731
    cols = lambda c: jnp.sum(c, axis=1, keepdims=True)  # noqa: E731
    e = jnp.exp(x - jnp.max(x, axis=2, keepdims=True))
    c = keep(e / rows(e) + eps)
    c = keep(c / (cols(c) + eps))

    def step(_, c):  # keep: with eps = 0 a padded row or column would be 0 / 0
        c = keep(c / (rows(c) + eps))
        return keep(c / (cols(c) + eps))

    return lax.fori_loop(0, iters - 1, step, c)


def _kernel(x_ref, o_ref, *, tokens: int, m: int, block: int, iters: int, eps: float):
    start = pl.program_id(0) * block
    mp = next_pow2(m)  # Triton tensors need power-of-two extents: an m that is not one is padded (masked)
    edge = None if mp == m else m
    bounds = (edge_bound(tokens, block), edge, edge)  # None: that dim needs no mask
    x = _backend.load_tile(x_ref, (start, 0, 0), (block, mp, mp), bounds).astype(jnp.float32)
    _backend.store_tile(o_ref, (start, 0, 0), project_tile(x, m=m, iters=iters, eps=eps), bounds)


@functools.partial(jax.jit, static_argnames=("iters", "eps", "block_sizes", "interpret"))
def sinkhorn(logits, *, iters: int, eps: float, block_sizes: BlockSizes | None = None, interpret: bool = False):
    """The Sinkhorn projection of every token's [m, m] logits (see `reference`).

    Args:
      logits: [..., m, m] floating point (computed in f32); leading dims are tokens.
      iters: normalisation rounds (>= 1; static). eps: added to the softmax and to every sum (static).
      block_sizes: `BlockSizes` (static) or None. interpret: Pallas interpreter.
    Returns:
      [..., m, m] float32, doubly stochastic up to eps.
    """
    validate_sinkhorn_static(logits, iters, eps)
    m = logits.shape[-1]
    tokens = math.prod(logits.shape[:-2])
    if tokens == 0:
        return jnp.zeros(logits.shape, jnp.float32)
    bs = block_sizes or BlockSizes.get_default(logits.dtype)
    block, warps = launch_block(bs, tokens)
    flat = logits.reshape(tokens, m, m)  # a bitcast
    whole = pl.BlockSpec(flat.shape, lambda p: (0, 0, 0))
    out = pl.pallas_call(
        functools.partial(_kernel, tokens=tokens, m=m, block=block, iters=iters, eps=float(eps)),
        grid=(cdiv(tokens, block),),
        in_specs=[whole],
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct(flat.shape, jnp.float32),
        compiler_params=_backend.compiler_params(num_warps=warps, num_stages=bs.num_stages, interpret=interpret),
        interpret=interpret,
        name="sinkhorn",
    )(flat)
    return out.reshape(logits.shape)
