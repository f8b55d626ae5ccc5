"""Interleaved partial RoPE on the trailing `rope_head_dim` channels (spec §3.3).

Sliding-only layers (and the MTP block) use the "main" frequencies (rope_theta, no YaRN); CSA/HCA layers
use the "compress" frequencies (compress_rope_theta with YaRN) for everything in the layer. Angles are
float32(position) * float32(theta_i); pair i rotates channels (base + 2i, base + 2i + 1).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.model.config import Config


def inv_frequencies(cfg: Config, *, compressed: bool) -> np.ndarray:
    """theta_i for i in [0, rope_head_dim/2), float32, computed exactly as the reference does."""
    dim = cfg.rope_head_dim
    base = cfg.compress_rope_theta if compressed else cfg.rope_theta
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = np.power(np.float32(base), exponents, dtype=np.float32)
    inv = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if not compressed or cfg.yarn is None:
        return inv
    y = cfg.yarn

    def correction_dim(rotations: float) -> float:
        return dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(y.beta_fast)), 0)
    high = min(math.ceil(correction_dim(y.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / np.float32(high - low), 0, 1).astype(np.float32)
    extrapolation = (1 - ramp).astype(np.float32)
    interpolation = (np.float32(1.0) / (np.float32(y.factor) * pos_freqs)).astype(np.float32)
    return (interpolation * (1 - extrapolation) + inv * extrapolation).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, *, inverse: bool = False) -> jax.Array:
    """Rotate the last 2*len(inv_freq) channels of x.

    x: [..., t, (heads,) dim]; positions: int [..., t] broadcastable against x's leading dims (the head axis, if
    any, is handled by passing x with an explicit head axis after t and positions without it).
    inverse=True applies the conjugate rotation (angle -t*theta), used on the attention output.
    """
    r = 2 * inv_freq.shape[0]
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., t, r/2]
    extra = x.ndim - angles.ndim  # head axes between t and channels
    angles = angles.reshape(angles.shape[:-1] + (1,) * extra + angles.shape[-1:])
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if inverse:
        sin = -sin
    nope, rot = x[..., :-r], x[..., -r:].astype(jnp.float32)
    a, b = rot[..., 0::2], rot[..., 1::2]
    rotated = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(rot.shape)
    return jnp.concatenate([nope, rotated.astype(x.dtype)], axis=-1)
