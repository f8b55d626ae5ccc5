"""One layer of a stacked weight, not sliced out of its stack: what a scanned layer body gets for its routed experts.

Under `lax.scan` each layer's parameters are dynamic slices of the stacked arrays. XLA folds such a slice into a
dot or an elementwise fusion, but a custom call (a Pallas kernel) needs its operand as a buffer of its own, so
the slice was copied at every step: a Flash layer's 256 FP4 experts are 3.4 GB (12.9 GB in bf16), copied whole
each decode step although a step reads only the selected experts (`flash_slice(16)` in FP8 + FP4 decoded at
40 ms a step on an H100, 4 % of its roofline, where the unrolled `flash_slice(4)` took 1.5 ms; session 16). The
grouped expert kernels index their weights by expert themselves, so they take the stack whole, its layer and
expert axes merged (a free reshape), with the selected experts' ids offset by ``index * experts``
(`runtime/routed_experts.py`); anything else takes `get()` (the slice, as before).

The FP8 dense linears of a scanned layer had the same copy (their matmul kernel took a 2-D weight: ~0.2 GB a Flash
layer read and written each step; `flash_slice(16)` at batch 1 on an H100: 6.86 ms a step with the experts in
place, 5.69 ms with these too, docs/benchmarks/scan_in_place/). They arrive as `QuantizedLayerOf`: a `QuantizedWeight`
to every consumer (its shape, dequantization and indexing are the layer's), whose `values` and `scales` are the
stacks with the layer beside them; the FP8 matmul kernel reads the layer in place (`runtime/kernels.fp8_linear`),
and a dequantization slices first, which XLA fuses into the dot's operand as it did before.

The unquantized (bf16 / f32) dense linears had it too, on the GPU: XLA's Triton GEMM fusion takes no dynamic slice
as an operand, so each scanned layer's dense weights were copied out of their stacks before every GEMM
(`flash_slice(12)` decode: 40 copy fusions, 579 MB per loop iteration of two layers; in the published format
still `wo_a`, 64 MB a Flash layer). When the step installs a kernel for them (`linear.layer_matmul`: the Pallas
dispatcher does), they arrive as `DenseLayerOf`s and the layer matmul kernel reads the stack in place for the
decode-sized row counts it serves; bigger products, and every other consumer, take the slice (`get()`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from ds4jax.model.quantized import Format, QuantizedWeight, is_quantized

# The params subtree a scanned body gets as `LayerOf`s instead of slices (`layer_stack.run`): per layer the
# largest by far, and read only through the routed-expert dispatch.
STACKED_SUBTREE = ("ffn", "experts")


@dataclasses.dataclass(frozen=True)
class LayerOf:
    """Layer `index` (a traced int32 scalar) of `stacked` (an array or `QuantizedWeight` with a leading layer axis)."""

    stacked: Any
    index: jax.Array

    def get(self) -> Any:
        """The layer's own weight (a dynamic slice of the stack)."""
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, self.index, keepdims=False), self.stacked)

    @property
    def layers(self) -> int:
        return jax.tree.leaves(self.stacked)[0].shape[0]

    def merged(self) -> tuple[Any, jax.Array]:
        """(the stack with its layer axis merged into the next one, the offset of this layer's first entry on the
        merged axis): [layers, experts, ...] -> [layers * experts, ...], expert e of this layer at offset + e."""
        experts = jax.tree.leaves(self.stacked)[0].shape[1]
        merge = lambda a: a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])  # noqa: E731
        return jax.tree.map(merge, self.stacked), self.index * experts


class DenseLayerOf(LayerOf):
    """Layer `index` of a stacked bf16 / f32 dense weight ([layers, in, out], or [layers, groups, in, out] for
    attention's grouped wo_a): what a scanned body's linears get when a layer matmul is installed."""

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stacked.shape[1:])

    @property
    def ndim(self) -> int:
        return self.stacked.ndim - 1

    @property
    def dtype(self) -> Any:
        return self.stacked.dtype


# The unquantized dense linears (`linear.linear` / `linear_f32` / `grouped_f32` consume them; layers/params.py
# names them) that a scanned body reads in place when the step installs a layer matmul: attention's projections,
# the compressors' and the indexer's, the router and the shared expert.
DENSE_LINEARS = frozenset({"wq_a", "wq_b", "wkv", "wo_a", "wo_b", "wgate", "weights_proj", "gate", "w1", "w2", "w3"})


def resolve(tree: Any) -> Any:
    """`tree` with every `LayerOf` replaced by its layer's weight (for code that reads per-layer arrays)."""
    return jax.tree.map(lambda x: x.get() if isinstance(x, LayerOf) else x, tree,
                        is_leaf=lambda x: isinstance(x, LayerOf))


@dataclasses.dataclass(frozen=True)
class QuantizedLayerOf(QuantizedWeight):
    """Layer `layer` (a traced int32 scalar) of a stacked FP8 dense weight: `values` [layers, in, out] and `scales`
    [layers, ...] are the stacks. Everything but the FP8 matmul kernel sees the layer's own `QuantizedWeight`."""

    layer: Any = None

    def get(self) -> QuantizedWeight:
        """The layer's own weight (a dynamic slice of the stacks)."""
        take = lambda a: jax.lax.dynamic_index_in_dim(a, self.layer, keepdims=False)  # noqa: E731
        return QuantizedWeight(take(self.values), take(self.scales), self.format, self.block)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape[1:])  # FP8: the logical shape is the stored one

    @property
    def ndim(self) -> int:
        return len(self.values.shape) - 1

    @property
    def nbytes(self) -> int:
        return (int(self.values.nbytes) + int(self.scales.nbytes)) // int(self.values.shape[0])

    def __getitem__(self, index) -> QuantizedWeight:
        return self.get()[index]

    def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
        return self.get().dequantize(dtype)


jax.tree_util.register_dataclass(QuantizedLayerOf, data_fields=["values", "scales", "layer"],
                                 meta_fields=["format", "block"])


# The mHC pre-step's small f32 operands (the hyper-connections' gate scales and biases, the sub-layers' RMSNorm
# weights), which a scanned body reads in their stacks where the step installs the mHC kernel (`mhc_in_place`): as
# slices, each was an asynchronous copy of its own before every kernel call (three a call, two calls a layer at
# every decode step). The projection weight `fn` stays a slice (XLA's mix matmul folds it into its operand).
MHC_OPERANDS = frozenset({("hc_attn", "scale"), ("hc_attn", "base"), ("hc_ffn", "scale"), ("hc_ffn", "base"),
                          ("attn_norm",), ("ffn_norm",)})
_MHC_IN_PLACE = contextvars.ContextVar("ds4jax_mhc_in_place", default=False)


@contextlib.contextmanager
def mhc_in_place():
    """While tracing inside this context, scanned bodies get their `MHC_OPERANDS` as `LayerOf`s (the consumer, the
    mHC kernel's dispatch, reads the layer in the stack)."""
    token = _MHC_IN_PLACE.set(True)
    try:
        yield
    finally:
        _MHC_IN_PLACE.reset(token)


def mhc_in_place_installed() -> bool:
    return _MHC_IN_PLACE.get()


def _keys(path) -> tuple:
    return tuple(getattr(k, "key", None) for k in path)


def _under_experts(path) -> bool:
    return _keys(path[:len(STACKED_SUBTREE)]) == STACKED_SUBTREE


def _dense_linear(path, w: Any, min_bytes: int) -> bool:
    name = getattr(path[-1], "key", None) if path else None
    return (name in DENSE_LINEARS and not is_quantized(w) and jnp.issubdtype(w.dtype, jnp.floating)
            and w.ndim >= 3 and w.nbytes // w.shape[0] >= min_bytes)


def reads_in_place(path, w: Any, *, dense_min_bytes: int | None = None, mhc: bool = False) -> bool:
    """Whether a scanned body reads the stacked leaf `w` (at `path` in a layer's params) in its stack: the routed
    experts (under `STACKED_SUBTREE`), the FP8 dense weights (2-D a layer, so [layers, in, out] stacked), whose
    linears go through `linear._project` (the FP8 matmul kernel, or a dequantization), where a layer matmul is
    installed (`dense_min_bytes` not None) the unquantized dense linears of at least that many bytes a layer, and
    with `mhc` the mHC kernel's operands (`MHC_OPERANDS`)."""
    if _under_experts(path):
        return True
    if mhc and _keys(path) in MHC_OPERANDS:
        return True
    if is_quantized(w):
        return w.format is Format.FP8 and len(w.values.shape) == 3
    return dense_min_bytes is not None and _dense_linear(path, w, dense_min_bytes)


def in_place(path, w: Any, layer: jax.Array) -> LayerOf | QuantizedLayerOf:
    """Layer `layer` of the stacked leaf `w` (one `reads_in_place` keeps) as the scanned body gets it."""
    if _under_experts(path) or _keys(path) in MHC_OPERANDS:
        return LayerOf(w, layer)
    if is_quantized(w):
        return QuantizedLayerOf(w.values, w.scales, w.format, w.block, layer)
    return DenseLayerOf(w, layer)
