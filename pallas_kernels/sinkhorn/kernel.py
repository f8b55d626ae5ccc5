"""Sinkhorn projection — portable Pallas kernel (Triton backend; interpret mode on CPU).

The whole projection (softmax, then `iters` column and iters - 1 row normalisations) in one launch. As an XLA
loop on a GPU every iteration is a few tiny kernel launches (twice per decoder layer); unrolled, XLA's GPU
compiler takes minutes over a decode loop. Here tokens run on lanes: program p takes `block` consecutive tokens,
gathers each token's m*m logits straight from the flat [tokens * m * m] array (element (i, j) of every token of
the block is one [block] vector), and does the row and column sums as m-term elementwise adds of those vectors
(static loops over m): no cross-lane reduction, any small m. The iterations are an in-kernel loop (scf.for).
The tail block's missing tokens are masked: never read, never written.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend
from pallas_kernels._util import cdiv
from pallas_kernels.sinkhorn.blocks import BlockSizes, launch_block
from pallas_kernels.sinkhorn.validate import validate_sinkhorn_static


def _sum(vectors):
    """Left-to-right sum of equal-shape vectors (elementwise adds only)."""
    return functools.reduce(lambda a, b: a + b, vectors)


def _normalise_rows(c, eps):
    return [[v / (_sum(row) + eps) for v in row] for row in c]


def _normalise_cols(c, eps):
    m = len(c)
    col = [_sum([c[i][j] for i in range(m)]) + eps for j in range(m)]
    return [[c[i][j] / col[j] for j in range(m)] for i in range(m)]


def _softmax_rows(x, eps):
    """Row softmax + eps, as `jax.nn.softmax`: exp(x - max) / sum."""
    out = []
    for row in x:
        top = functools.reduce(jnp.maximum, row)
        e = [jnp.exp(v - top) for v in row]
        total = _sum(e)
        out.append([v / total + eps for v in e])
    return out


def _kernel(x_ref, o_ref, *, tokens: int, m: int, block: int, iters: int, eps: float):
    token = pl.program_id(0) * block + lax.broadcasted_iota(jnp.int32, (block,), 0)
    live = token < tokens  # the tail block's missing tokens: masked loads and stores touch nothing
    first = token * (m * m)  # flat offset of each token's element (0, 0)
    x = [[_backend.load_1d(x_ref, first + (i * m + j), live, 0).astype(jnp.float32) for j in range(m)]
         for i in range(m)]
    c = _normalise_cols(_softmax_rows(x, eps), eps)

    def step(_, flat):
        c = [list(flat[i * m:(i + 1) * m]) for i in range(m)]
        c = _normalise_cols(_normalise_rows(c, eps), eps)
        return tuple(v for row in c for v in row)

    flat = lax.fori_loop(0, iters - 1, step, tuple(v for row in c for v in row))
    for k, v in enumerate(flat):
        _backend.store_1d(o_ref, first + k, v, live)


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
    flat = logits.reshape(-1)  # a bitcast: the kernel gathers each token's elements in place
    whole = pl.BlockSpec(flat.shape, lambda p: (0,))
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
