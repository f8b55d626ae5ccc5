"""The FP8 KV cache's number format: E4M3 values with one float32 scale per cached row (per entry / per token).

`PoolSpec(kv_dtype=...)` chooses the storage of the KV arrays (swa_kv, c4_kv, indexer_kv, c128_kv):

* ``"auto"`` (the default): the model's dtype (`PoolSpec.dtype`), no scales — the path as it always was;
* ``"fp8"``: the device's FP8 E4M3 variant, resolved once from the device (`runtime.target.Target.fp8_dtype`):
  ``float8_e4m3fn`` (OCP; NVIDIA, MI355, CPU) or ``float8_e4m3fnuz`` (MI300, whose FP8 is FNUZ only);
* either name explicitly, to build the pools of another target (a ROCm lowering check on this host).

A row x (one SWA token, one C4 / C128 entry, one indexer key) is stored as round(x / s) in E4M3 with
s = max|x| / FP8_MAX (448 for OCP, 240 for FNUZ: each format's largest finite value), and s in float32 beside it
(`*_scale` pool arrays). One scale per row is what the peers' FP8 caches keep per token; a row of all zeros gets
s = 1. The compressor state rings stay in `state_dtype`: they hold running accumulators, not cached keys.

Every KV row is quantized when it is produced and only its quantized form is ever read, by this step's own
queries as well as later steps' (the SWA keys of a chunk are quantized before the chunk attends to them), so
attention sees the same keys however a prompt is chunked.
"""

from __future__ import annotations

import jax.numpy as jnp

from ds4jax.errors import ArgumentError, PoolSpecError
from ds4jax.runtime import target

AUTO = "auto"
# largest finite value of each E4M3 variant (ml_dtypes.finfo(...).max): the scale maps a row's max |x| onto it
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e4m3fnuz": 240.0}
CHOICES = (AUTO, "fp8", *FP8_MAX)


def resolve(kv_dtype) -> str:
    """A `kv_dtype` argument -> the name a `PoolSpec` stores: "auto", or the E4M3 variant's dtype name."""
    name = kv_dtype if isinstance(kv_dtype, str) else getattr(kv_dtype, "__name__", None) or str(kv_dtype)
    if name == "fp8":
        return jnp.dtype(target.device_target().fp8_dtype).name
    if name == AUTO or name in FP8_MAX:
        return name
    raise PoolSpecError(f"PoolSpec.kv_dtype: expected one of {', '.join(map(repr, CHOICES))}, got {kv_dtype!r}")


def check_argument(kv_dtype, name: str = "kv_dtype") -> str:
    """`resolve` for an API argument: `ArgumentError` naming it (before any engine is built)."""
    try:
        return resolve(kv_dtype)
    except PoolSpecError:
        raise ArgumentError(f"must be one of {', '.join(map(repr, CHOICES))}", name=name, value=kv_dtype) from None


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype).name in FP8_MAX


# FNUZ has no negative zero: its 0x80 is NaN. A negative value that rounds to zero (|x| <= 2**-11, half of FNUZ's
# smallest subnormal 2**-10; the tie rounds to even, which is zero) must become +0. ml_dtypes and XLA's default CPU emitters do that, but XLA:CPU's
# loop emitters (`--xla_cpu_use_fusion_emitters=false`) write 0x80, and a converter we do not control may too.
_FNUZ_ROUNDS_TO_ZERO = 2.0 ** -11


def cast_e4m3(x, dtype):
    """float32 x (within the format's range) -> the E4M3 `dtype`, round to nearest; in FNUZ what rounds to zero is
    +0 on every backend (never NaN)."""
    if jnp.dtype(dtype) == jnp.dtype(jnp.float8_e4m3fnuz):
        x = jnp.where(jnp.abs(x) <= _FNUZ_ROUNDS_TO_ZERO, jnp.zeros_like(x), x)
    return x.astype(dtype)


def quantize(x, dtype):
    """x [..., w] -> (values [..., w] in the E4M3 `dtype`, scales [...] float32): one scale per row of x."""
    fmax = FP8_MAX[jnp.dtype(dtype).name]
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / fmax, 1.0)
    # clip: x / (amax / fmax) may round a hair past fmax, which the cast would turn into NaN
    values = cast_e4m3(jnp.clip(x / scale[..., None], -fmax, fmax), dtype)
    return values, scale


def dequantize(values, scales, dtype=jnp.float32):
    """values [..., w] E4M3, scales [...] -> [..., w] in `dtype`."""
    return (values.astype(jnp.float32) * scales[..., None]).astype(dtype)
