"""The official inference code's rounding (spec §7.2): the QAT simulations ``numerics="official"`` applies.

The released runtime fake-quantises a few tensors in place (quantise, then dequantise straight back), so the
model sees them as the quantisation-aware training did. The recipes, as pure functions:

* `fp8_round(x, block)`: per block of `block` values along the last axis, amax = max(|x|, 1e-4),
  s = 2^ceil(log2(amax / 448)) (`pow2_scale`, the runtime's ``fast_round_scale``: UE8M0 power-of-two scales),
  x~ = e4m3(clip(x / s, -448, 448)) * s;
* `fp4_round(x, block=32)`: the same with amax floor 6 * 2^-126, s = 2^ceil(log2(amax / 6)) and the e2m1 grid
  (0, 0.5, 1, 1.5, 2, 3, 4, 6; round to nearest, ties to the even code);
* `hadamard(x)`: the orthonormal Walsh-Hadamard transform in Sylvester order, scaled 1 / sqrt(n).

And where the model applies them (a no-op under ``numerics="reference"``, the HF-matching path):

* `round_kv`: the K=V vector and every main compressed entry, FP8 in blocks of 64 over the non-rope dims
  (0..head_dim - rope_dim); the rope dims stay as they are;
* `round_index`: indexer queries and keys, Hadamard then FP4 in blocks of 32;
* `round_act`: the input of every linear the official checkpoint stores in FP8 / FP4 (wq_a, wq_b, wkv, wo_b,
  the indexer's wq_b, the shared expert, the routed experts' input, MTP e_proj / h_proj), FP8 in blocks of 128.

A block that does not fill `block` values (tiny test configs) is rounded as a block of its own size. Results come
back in the input's dtype: every rounded value (e4m3 / e2m1 times a power of two) is exact in bfloat16 and float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.io.quant_formats import FP4_MAX, FP8_MAX
from ds4jax.model.config import Config, Numerics
from ds4jax.model.quantized import e2m1_codes

FP8_AMAX_FLOOR = 1e-4
FP4_AMAX_FLOOR = 6.0 * 2.0**-126  # keeps amax / 6 a normal float32, where the exponent-bit ceil below is exact
KV_BLOCK, ACT_BLOCK, FP4_BLOCK = 64, 128, 32


def pow2_scale(amax: jax.Array, inv_max: float) -> jax.Array:
    """2^ceil(log2(amax * inv_max)) for positive normal float32 products, from the exponent and mantissa bits (the
    runtime's ``fast_round_scale``: the product rounds in float32 first, as there)."""
    y = amax.astype(jnp.float32) * jnp.float32(inv_max)
    bits = jax.lax.bitcast_convert_type(y, jnp.int32)
    exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
    return jax.lax.bitcast_convert_type((exponent + 127) << 23, jnp.float32)


def _blockwise(x: jax.Array, block: int, amax_floor: float, top: float, round_fn) -> jax.Array:
    """Fake-quantise the last axis of x in blocks: round_fn(x / s) * s with one power-of-two s per block."""
    d = x.shape[-1]
    block = min(block, d)
    pad = -d % block
    xf = jnp.pad(x.astype(jnp.float32), [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    g = xf.reshape(*xf.shape[:-1], -1, block)
    amax = jnp.maximum(jnp.max(jnp.abs(g), axis=-1, keepdims=True), amax_floor)
    s = pow2_scale(amax, 1.0 / top)
    y = round_fn(jnp.clip(g / s, -top, top)) * s
    return y.reshape(xf.shape)[..., :d].astype(x.dtype)


def e4m3(x: jax.Array) -> jax.Array:
    """float32 within +-448 -> the nearest float8_e4m3fn value (ties to even), as float32."""
    return x.astype(jnp.float8_e4m3fn).astype(jnp.float32)


def e2m1(x: jax.Array) -> jax.Array:
    """float32 within +-6 -> the nearest e2m1 value (ties to the even code), as float32; signs kept (-0 too)."""
    from pallas_kernels._mxfp4 import e2m1_to_float  # lazily: a cached run never traces this

    return e2m1_to_float(e2m1_codes(x))


def fp8_round(x: jax.Array, block: int) -> jax.Array:
    return _blockwise(x, block, FP8_AMAX_FLOOR, FP8_MAX, e4m3)


def fp4_round(x: jax.Array, block: int = FP4_BLOCK) -> jax.Array:
    return _blockwise(x, block, FP4_AMAX_FLOOR, FP4_MAX, e2m1)


@functools.lru_cache(maxsize=8)
def sylvester(n: int) -> np.ndarray:
    """[n, n] orthonormal Hadamard matrix in Sylvester (natural) order: H_2k = [[H, H], [H, -H]] / sqrt(2)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two size, got {n}")
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def hadamard(x: jax.Array) -> jax.Array:
    """x [..., n] -> x H (H symmetric, orthonormal), computed in float32, back in x's dtype."""
    h = jnp.asarray(sylvester(x.shape[-1]))
    y = jnp.einsum("...i,ij->...j", x.astype(jnp.float32), h, precision=jax.lax.Precision.HIGHEST)
    return y.astype(x.dtype)


# ---- where the model applies them --------------------------------------------------------------------------------

def official(cfg: Config) -> bool:
    return cfg.numerics is Numerics.OFFICIAL


def round_kv(x: jax.Array, cfg: Config) -> jax.Array:
    """A K=V row or main compressed entry [..., head_dim]: FP8 (blocks of 64) on the non-rope dims."""
    if not official(cfg):
        return x
    nope = x.shape[-1] - cfg.rope_head_dim
    return jnp.concatenate([fp8_round(x[..., :nope], KV_BLOCK), x[..., nope:]], axis=-1)


def round_index(x: jax.Array, cfg: Config) -> jax.Array:
    """An indexer query head or key [..., index_head_dim]: Hadamard, then FP4 (blocks of 32)."""
    return fp4_round(hadamard(x), FP4_BLOCK) if official(cfg) else x


def round_act(x: jax.Array, cfg: Config) -> jax.Array:
    """The input of an FP8 / FP4 linear [..., in]: FP8 (blocks of 128)."""
    return fp8_round(x, ACT_BLOCK) if official(cfg) else x
