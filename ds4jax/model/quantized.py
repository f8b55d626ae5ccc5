"""Quantized weights on the device: the checkpoint's FP8 / FP4 bytes and scales, consumed as they are.

`QuantizedWeight` is a pytree leaf pair (`values`, `scales`) with the format and the block size as static
metadata, so a jitted step specializes on them and the arrays travel, stack and slice like any params leaf. It
lives in the params layout (inputs before outputs, like the dense ``[in, out]`` kernels):

* ``FP8``: values float8_e4m3fn ``[..., in, out]`` (float8_e4m3fnuz on gfx942: `runtime.target`), scales
  float32 ``[..., ceil(in/bi), ceil(out/bo)]`` for blocks ``block = (bi, bo)``; W = float(v) * s[i // bi, o // bo].
* ``FP4``: values uint8 ``[..., in/2, out]`` (row j holds inputs 2j in its low nibble and 2j + 1 in its high one),
  scales E8M0 bytes uint8 ``[..., in/32, out]``; block = (32, 1).

Dense FP8 linears read the stored bytes in the FP8 matmul kernel when the steps run the Pallas kernels
(`pallas_kernels.fp8_matmul`, dispatched by `ds4jax.runtime.kernels.dense_linears`); otherwise they dequantize
next to their matmul (`dense`), a convert and a multiply that XLA fuses into the dot's operand. Routed experts read
FP4 and FP8 in the grouped-matmul kernels (`pallas_kernels.grouped_matmul_fp4` / `grouped_matmul_fp8`). The loader
fills these from the checkpoint bytes (`ds4jax.load(..., weights="checkpoint")`).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np



# e2m1 magnitudes 0 0.5 1 1.5 2 3 4 6: the midpoints between neighbours; at a midpoint the even code wins
# (round half to even on the mantissa bit), so the comparison is > where the lower code is even, >= where odd
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_codes(x: jax.Array) -> jax.Array:
    """float32 with |x| <= 6 -> e2m1 codes (int32), round to nearest, ties to even (the FP4 quantizer and
    `official_numerics`' FP4 rounding; `_mxfp4.e2m1_to_float` decodes them)."""
    m = jnp.abs(x)
    code = sum(((m >= t) if odd_below else (m > t)).astype(jnp.int32) for t, odd_below in _E2M1_MIDPOINTS)
    return jnp.where(jnp.signbit(x), code | 8, code)


class Format(enum.Enum):
    FP8 = "fp8"
    FP4 = "fp4"


FP4_BLOCK = (32, 1)


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    values: Any
    scales: Any
    format: Format = dataclasses.field(metadata={"static": True})
    block: tuple[int, int] = dataclasses.field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (dequantized) shape."""
        *lead, rows, cols = self.values.shape
        return (*lead, rows * 2 if self.format is Format.FP4 else rows, cols)

    @property
    def ndim(self) -> int:
        return len(self.values.shape)

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes) + int(self.scales.nbytes)

    def __getitem__(self, index) -> "QuantizedWeight":
        """Index the leading (expert or layer) axes: values and scales alike."""
        return dataclasses.replace(self, values=self.values[index], scales=self.scales[index])

    def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
        # pallas_kernels imports lazily (its package import is ~60 ms of every start-up otherwise)
        from pallas_kernels import _mxfp4
        from pallas_kernels.fp8_matmul import dequantize_fp8

        if self.format is Format.FP4:
            return _mxfp4.dequantize_fp4(self.values, self.scales, dtype)
        return dequantize_fp8(self.values, self.scales, self.block, dtype)


jax.tree_util.register_dataclass(QuantizedWeight, data_fields=["values", "scales"], meta_fields=["format", "block"])


def dense(w: Any, dtype: Any) -> jax.Array:
    """A weight in `dtype` whatever it is stored as (a `QuantizedWeight` is dequantized here, inside the trace)."""
    return w.dequantize(dtype) if isinstance(w, QuantizedWeight) else w.astype(dtype)


def is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedWeight)


def has_quantized(params: Any) -> bool:
    return any(is_quantized(x) for x in jax.tree.leaves(params, is_leaf=is_quantized))


def dequantize_tree(params: Any, dtype: Any = jnp.float32) -> Any:
    """Every `QuantizedWeight` of a params tree replaced by its dequantized values (on the host, numpy)."""
    return jax.tree.map(lambda w: np.asarray(w.dequantize(dtype)) if is_quantized(w) else w, params,
                        is_leaf=is_quantized)
