"""One layer of a stacked weight, not sliced out of its stack: what a scanned layer body gets for its routed experts.

Under `lax.scan` each layer's parameters are dynamic slices of the stacked arrays. XLA folds such a slice into a
dot or an elementwise fusion, but a custom call (a Pallas kernel) needs its operand as a buffer of its own, so
the slice was copied at every step: a Flash layer's 256 FP4 experts are 3.4 GB (12.9 GB in bf16), copied whole
each decode step although a step reads only the selected experts (`flash_slice(16)` in FP8 + FP4 decoded at
40 ms a step on an H100, 4 % of its roofline, where the unrolled `flash_slice(4)` took 1.5 ms; session 16). The
grouped expert kernels index their weights by expert themselves, so they take the stack whole, its layer and
expert axes merged (a free reshape), with the selected experts' ids offset by ``index * experts``
(`runtime/routed_experts.py`); anything else takes `get()` (the slice, as before).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

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


def resolve(tree: Any) -> Any:
    """`tree` with every `LayerOf` replaced by its layer's weight (for code that reads per-layer arrays)."""
    return jax.tree.map(lambda x: x.get() if isinstance(x, LayerOf) else x, tree,
                        is_leaf=lambda x: isinstance(x, LayerOf))
