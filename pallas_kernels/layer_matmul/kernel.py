"""Dense matmul with one layer of a stacked bf16 / f32 weight — portable Pallas kernel (Triton backend; interpret
mode on CPU).

Why: under `lax.scan` a layer's weights are dynamic slices of stacked arrays, and on the GPU XLA copies such a
slice into a buffer of its own before a Triton GEMM fusion reads it (the fusion takes no dynamic slice as an
operand): a scanned layer's dense weights were read, written and read again at every decode step (`flash_slice(12)`:
40 copy fusions, 579 MB per loop iteration of two layers; docs/benchmarks/step_kernels_deviceless/). This kernel
takes the whole stack and the layer index and loads its tiles at that layer, so nothing is sliced or copied — the
unquantized counterpart of `fp8_matmul`'s stacked path (ds4jax/model/layer_of.py chooses who gets it).

Program (row tile, column block, k split[, group]) streams its [block_k, block_n] weight tiles from
``stack[layer(, group)]`` and accumulates x @ w in f32; k splits write partials that the wrapper sums. Tiles that
cross an edge are read and written with masked loads and stores (nothing past the arrays is touched). Grouped form
(attention's wo_a: one [k, n] weight per output group): x [g, m, k], stack [layers, g, k, n], a grid axis per group.
Tile sizes are `fp8_matmul`'s `BlockSizes` (decode: one 16-row tile and k split so that enough programs stream the
weight; prefill: 64-row tiles); with a 2-byte weight a stage is 16 x 64 x 2 + 64 x 64 x 2 = 10 KB, well inside
ROCm's 64 KB LDS at 3 stages.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _backend
from pallas_kernels._dense_tiles import split_k_program
from pallas_kernels._util import cdiv
from pallas_kernels.fp8_matmul.blocks import BlockSizes, tiles
from pallas_kernels.grouped_matmul.blocks import choose_k_splits
from pallas_kernels.grouped_matmul.tiles import sum_splits
from pallas_kernels.layer_matmul.validate import validate_layer_matmul_static

_UNBLOCKED = (1 << 30, 1 << 30)  # no scale blocks: any power-of-two tile fits (`tiles` cuts tiles to scale blocks)


def _kernel(layer_ref, x_ref, w_ref, o_ref, *, grouped, tile_m, block_k, block_n, steps, precision):
    group = (pl.program_id(3),) if grouped else ()

    def load_weight(k0, n0, k_edge, n_edge):
        w = _backend.load_tile(w_ref, (k0, n0), (block_k, block_n), (k_edge, n_edge), lead=(layer_ref[0], *group))
        return w.astype(x_ref.dtype)

    split_k_program(x_ref, o_ref, load_weight, n=w_ref.shape[-1], tile_m=tile_m, block_k=block_k, block_n=block_n,
                    steps=steps, precision=precision, x_lead=group)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def layer_matmul(x, stack, layer, *, block_sizes=None, interpret=False):
    """y = x @ stack[layer] (see `reference`), the stack read in place.

    Args:
      x: [m, k] bf16/f32, or [groups, m, k] (grouped).
      stack: [layers, k, n] bf16/f32 (cast to x's dtype per tile), or [layers, groups, k, n] with a grouped x.
      layer: int32 scalar (traced), the stack's layer. Not checked against the stack's depth in the kernel (it
        would read another layer's or no memory): callers pass a scan's own counter (ds4jax/model/layer_stack.py).
      block_sizes: `pallas_kernels.fp8_matmul.BlockSizes` (static) or None (its default for x's dtype and rows).
      interpret: Pallas interpreter.
    Returns:
      [m, n] f32, or [groups, m, n].
    """
    validate_layer_matmul_static(x, stack, layer)
    grouped = x.ndim == 3
    m, k = x.shape[-2:]
    n = stack.shape[-1]
    groups = x.shape[:1] if grouped else ()
    bs = block_sizes or BlockSizes.get_default(x.dtype, m)
    tile_m, block_k, block_n = tiles(bs, _UNBLOCKED, m, k, n, _backend.min_dot_dim(interpret))
    m_tiles, n_blocks, k_blocks = cdiv(m, tile_m), cdiv(n, block_n), cdiv(k, block_k)
    k_splits = choose_k_splits(bs.k_splits, tiles=m_tiles * max(groups or (1,)), n_blocks=n_blocks,
                               k_blocks=k_blocks)
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)  # noqa: E731
    layers = jnp.asarray(layer, jnp.int32).reshape(1)
    out = pl.pallas_call(
        functools.partial(_kernel, grouped=grouped, tile_m=tile_m, block_k=block_k, block_n=block_n,
                          steps=k_blocks // k_splits, precision=_backend.dot_precision(x.dtype)),
        grid=(m_tiles, n_blocks, k_splits, *groups),
        in_specs=[whole(layers), whole(x), whole(stack)],
        # each split (and group) its own whole [m, n] partial
        out_specs=pl.BlockSpec((None, *(None for _ in groups), m, n), lambda i, j, s, *g: (s, *g, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((k_splits, *groups, m, n), jnp.float32),
        compiler_params=_backend.compiler_params(num_warps=bs.num_warps, num_stages=bs.num_stages,
                                                 interpret=interpret),
        interpret=interpret,
        name="layer_matmul",
    )(layers, x, stack)
    (y,) = sum_splits((out,))
    return y
