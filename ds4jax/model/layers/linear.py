"""Dense projections. Weights are [in, out] (an array, or an FP8 `QuantizedWeight`); accumulation is float32, one
cast to the activation dtype.

An FP8 weight is dequantized next to the dot (XLA fuses the convert and the block-scale multiply into the dot's
operand), unless the step being traced installed a matmul for FP8 weights (`fp8_matmul`: the kernel dispatcher
does for the Pallas kernels, `ds4jax.runtime.kernels.dense_linears`), which then reads the FP8 bytes itself.
The choice is made while tracing: each compiles its own program.

A scanned layer's unquantized dense weights arrive as `DenseLayerOf`s (the stack and the layer: layer_of.py) when
the step installed a layer matmul (`layer_matmul`, the Pallas dispatcher does): up to `IN_PLACE_ROWS` rows it reads
the layer in its stack; bigger products take the layer's slice (XLA's copy of it costs little beside their FLOPs).
"""

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp

from ds4jax.model.layer_of import DenseLayerOf
from ds4jax.model.quantized import Format, dense, is_quantized

# fn(x [m, in], w: FP8 QuantizedWeight [in, out]) -> [m, out] f32, or None: dequantize next to the dot
_FP8_MATMUL = contextvars.ContextVar("ds4jax_fp8_matmul", default=None)
# (fn(x [m, in] or [g, m, in], w: DenseLayerOf) -> [m, out] / [g, m, out] f32, the smallest weight a layer it
# takes in bytes), or None: slice the layer out
_LAYER_MATMUL = contextvars.ContextVar("ds4jax_layer_matmul", default=None)
# Rows up to which a `DenseLayerOf` is read in place: decode and verify steps (8 rows x 4 tokens at k = 3 is 32);
# a prefill chunk's GEMM is compute-bound, and XLA's own GEMM on the sliced copy serves it.
IN_PLACE_ROWS = 64


@contextlib.contextmanager
def fp8_matmul(fn):
    """While tracing inside this context, every FP8 dense linear calls `fn(x2d, w)` (None = dequantize + dot)."""
    token = _FP8_MATMUL.set(fn)
    try:
        yield
    finally:
        _FP8_MATMUL.reset(token)


@contextlib.contextmanager
def layer_matmul(fn, min_bytes: int = 0):
    """While tracing inside this context, scanned layers keep their dense weights of at least `min_bytes` a layer
    in their stacks (`DenseLayerOf`) and linears of up to `IN_PLACE_ROWS` rows call `fn(x, w)` on them."""
    token = _LAYER_MATMUL.set((fn, min_bytes))
    try:
        yield
    finally:
        _LAYER_MATMUL.reset(token)


def layer_matmul_min_bytes() -> int | None:
    """The smallest weight a layer the installed layer matmul takes, or None when none is installed."""
    installed = _LAYER_MATMUL.get()
    return None if installed is None else installed[1]


def _in_place(x: jax.Array, w: DenseLayerOf, rows: int):
    """fn(x, w) when installed and `rows` is small enough, else None (the caller slices the layer out)."""
    installed = _LAYER_MATMUL.get()
    return installed[0](x, w) if installed is not None and rows <= IN_PLACE_ROWS else None


def _project(x: jax.Array, w, precision=None) -> jax.Array:
    if isinstance(w, DenseLayerOf):
        y = _in_place(x.reshape(-1, x.shape[-1]), w, math.prod(x.shape[:-1]))
        if y is not None:
            return y.reshape(*x.shape[:-1], y.shape[-1])
        w = w.get()
    fn = _FP8_MATMUL.get()
    if fn is not None and is_quantized(w) and w.format is Format.FP8 and w.ndim == 2:
        y = fn(x.reshape(-1, x.shape[-1]), w)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    if math.prod(x.shape[:-1]) == 1 and w.ndim == 2:
        return _one_row(x, w, precision)
    return jnp.einsum("...i,io->...o", x, dense(w, x.dtype), preferred_element_type=jnp.float32, precision=precision)


def _one_row(x: jax.Array, w, precision=None) -> jax.Array:
    """One token's projection as a two-row matmul (the row repeated, the copy dropped).

    XLA:GPU rewrites a dot whose left side is a vector into multiply + reduce when the weight has fewer than ~10M
    elements (its algebraic simplifier's dot strength reduction; no flag turns it off), and on the decode step at
    batch 1 it then wrote the [in, out] float32 product to memory between two kernels: 4x the weight's bytes for
    wq_a, wkv, the compressors, the router and the shared expert (`scripts/step_kernels.py`,
    `scripts/probe_gemv.py`). With two rows the dot stays a GEMM that reads the weight once; the pad fuses with the
    producer of x (flash_slice(2) decode at batch 1 on an H100, 8 steps per call: 1.24 -> 1.03 ms per step;
    304 -> 278 launches for flash_slice(4)). ROCm's XLA shares the simplifier. The second row costs nothing on a
    memory-bound GEMV."""
    # the second row a broadcast of the first, not a zero pad: XLA's Triton GEMM fusion takes a broadcast into its
    # operand, while a pad after a producer it cannot fuse with (a Pallas call: the mHC pre-step) is a kernel of
    # its own (two a layer at decode batch 1; with the slot-row gather of steps._slot_rows, flash_slice(4)'s decode
    # step went from 207 to 192 launches on the H200, docs/benchmarks/launches_ab_h200/).
    x2 = jnp.broadcast_to(x.reshape(1, x.shape[-1]), (2, x.shape[-1]))
    y = jax.lax.dot_general(x2, dense(w, x.dtype), (((1,), (0,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32)
    return y[:1].reshape(*x.shape[:-1], y.shape[-1])


def grouped_f32(x: jax.Array, w) -> jax.Array:
    """x [g, n, i] @ w [g, i, o] (cast to x's dtype) -> [g, n, o] float32 (a batched matmul every backend
    supports); one row (n = 1) goes through two, as in `_one_row` (attention's wo_a at decode batch 1 was a
    multiply + reduce kernel reading its 67 MB at ~30 % of the bandwidth, every layer). A `DenseLayerOf` w: the
    layer matmul reads it in its stack (see `layer_matmul`), or its layer is sliced out."""
    rows = x.shape[1]
    if isinstance(w, DenseLayerOf):
        y = _in_place(x, w, rows)
        if y is not None:
            return y
        w = w.get()
    w = w.astype(x.dtype)
    x = jnp.pad(x, ((0, 0), (0, 1), (0, 0))) if rows == 1 else x
    return jnp.einsum("gni,gio->gno", x, w, preferred_element_type=jnp.float32)[:, :rows]


def linear(x: jax.Array, w) -> jax.Array:
    return _project(x, w).astype(x.dtype)


def linear_f32(x: jax.Array, w, precision=None) -> jax.Array:
    """A projection whose result stays float32 (router logits, indexer head weights); `precision` as XLA's."""
    return _project(x, w, precision)
