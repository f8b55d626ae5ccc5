"""Dense matmul with block-scaled FP8 weights — portable Pallas kernel (Triton backend; interpret mode on CPU).

The FP8 dense linears of a quantized checkpoint, read as stored: 1 byte per weight (+ one f32 per 128 x 128
block) instead of bf16's 2. Program (row tile, column block, k split) streams its [block_k, block_n] E4M3 tiles
and their scale (a tile lies inside one scale block: one scalar per step), decodes them in registers to x's dtype
— the same rounding as the dequantize-then-dot reference — and accumulates the dot in f32. FNUZ values (MI300)
enter as their bytes and are decoded with integer ops (`_fp8`: Pallas' Triton lowering has no FNUZ conversion).

Shapes need not be multiples of the tiles: tiles crossing the edge of x, the weight or the output are read and
written with masked loads and stores (nothing past the arrays is touched, and nothing is padded or copied).
Decode (m <= 16): one 16-row tile, k split so that enough programs stream the weight (the grouped matmul's
heuristic); the k splits' f32 partials are summed by the wrapper. Prefill: 64-row tiles, usually one split.

A scanned layer's weight is read in its stack: values [layers, k, n] and scales [layers, ...] with `layer` (a
traced int32 scalar) choosing one. The kernel takes the layer as a leading index of its loads, so the stack is
neither sliced nor copied (a slice handed to a custom call is a buffer of its own: XLA copied every scanned layer's
FP8 dense weights at every step, ~0.2 GB a Flash layer; see ds4jax/model/layer_of.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _backend
from pallas_kernels._fp8 import kernel_operand, to_compute
from pallas_kernels._dense_tiles import split_k_program
from pallas_kernels._util import cdiv
from pallas_kernels.fp8_matmul.blocks import BlockSizes, tiles
from pallas_kernels.fp8_matmul.validate import validate_fp8_matmul_static
from pallas_kernels.grouped_matmul.blocks import choose_k_splits
from pallas_kernels.grouped_matmul.tiles import sum_splits


def _kernel(x_ref, v_ref, s_ref, layer_ref, o_ref, *, block, tile_m, block_k, block_n, steps, precision):
    lead = () if layer_ref is None else (layer_ref[0],)  # a stacked weight: the layer, a leading index of the loads

    def load_weight(k0, n0, k_edge, n_edge):
        v = _backend.load_tile(v_ref, (k0, n0), (block_k, block_n), (k_edge, n_edge), lead=lead)
        scale = s_ref[(*lead, k0 // block[0], n0 // block[1])]
        return (to_compute(v, jnp.float32) * scale).astype(x_ref.dtype)  # = the reference's dequantized tile

    split_k_program(x_ref, o_ref, load_weight, n=v_ref.shape[-1], tile_m=tile_m, block_k=block_k,
                    block_n=block_n, steps=steps, precision=precision)


def _kernel_refs(*refs, stacked: bool, **kw):
    """`_kernel` with the layer's ref (None for a 2-D weight): a pallas_call's refs are its operands', in order."""
    x_ref, v_ref, s_ref, *rest = refs
    layer_ref, o_ref = rest if stacked else (None, rest[0])
    _kernel(x_ref, v_ref, s_ref, layer_ref, o_ref, **kw)


@functools.partial(jax.jit, static_argnames=("block", "block_sizes", "interpret"))
def fp8_matmul(x, values, scales, *, block=(128, 128), block_sizes=None, interpret=False, layer=None):
    """y = x @ dequantize(values, scales) (see `reference`), the weight read as stored.

    Args:
      x: [m, k] bf16/f32. values: [k, n] float8_e4m3fn or float8_e4m3fnuz (the dtype decides the decode), or a
      stack [layers, k, n] of them with `layer`.
      scales: [ceil(k / bi), ceil(n / bo)] f32 for block = (bi, bo) (static); [layers, ...] with a stack.
      block_sizes: `BlockSizes` (static) or None (`BlockSizes.get_default(x.dtype, m)`). interpret: Pallas
      interpreter.
      layer: int32 scalar, the stack's layer to multiply by (traced; required with a stack, None without). Not
      checked against the stack's depth in the kernel (it would read another layer's or no memory): callers pass
      a scan's own counter (ds4jax/model/layer_stack.py); the reference clamps, as a dynamic slice does.
    Returns:
      [m, n] f32.
    """
    block = tuple(block)
    validate_fp8_matmul_static(x, values, scales, block, layer)
    m, k = x.shape
    n = values.shape[-1]
    bs = block_sizes or BlockSizes.get_default(x.dtype, m)
    tile_m, block_k, block_n = tiles(bs, block, m, k, n, _backend.min_dot_dim(interpret))
    m_tiles, n_blocks, k_blocks = cdiv(m, tile_m), cdiv(n, block_n), cdiv(k, block_k)
    k_splits = choose_k_splits(bs.k_splits, tiles=m_tiles, n_blocks=n_blocks, k_blocks=k_blocks)
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, j, s: (0,) * a.ndim)
    operand = kernel_operand(values)  # FNUZ as its bytes
    layers = () if layer is None else (jnp.asarray(layer, jnp.int32).reshape(1),)
    out = pl.pallas_call(
        functools.partial(_kernel_refs, stacked=layer is not None, block=block, tile_m=tile_m, block_k=block_k,
                          block_n=block_n, steps=k_blocks // k_splits, precision=_backend.dot_precision(x.dtype)),
        grid=(m_tiles, n_blocks, k_splits),
        in_specs=[whole(x), whole(operand), whole(scales)] + [whole(a) for a in layers],
        out_specs=pl.BlockSpec((None, m, n), lambda i, j, s: (s, 0, 0)),  # each split its own partial, whole
        out_shape=jax.ShapeDtypeStruct((k_splits, m, n), jnp.float32),
        compiler_params=_backend.compiler_params(num_warps=bs.num_warps, num_stages=bs.num_stages,
                                                 interpret=interpret),
        interpret=interpret,
        name="fp8_matmul",
    )(x, operand, scales, *layers)
    (y,) = sum_splits((out,))
    return y
