"""KV compressors (spec §3.6 HCA, §3.7 CSA): softmax-gated, per-channel pooling of token windows.

A token s contributes (kv_s, gate_s + ape[s mod ratio]) projections. HCA pools the `ratio` tokens of window w
(width c = 1). CSA (overlap) pools 2*ratio slots: the previous window's first-half channels and the current
window's second-half channels (width c = 2; window 0's previous half has weight 0). The pooled vector is
RMS-normalised and rotated at position w*ratio with the layer's (compress) RoPE.
"""

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.model.layers.linear import linear
from ds4jax.model.layers.norms import rms_norm
from ds4jax.model.layers.rope import apply_rope


def project(x: jax.Array, p: dict) -> tuple[jax.Array, jax.Array]:
    """x [..., e] -> (kv [..., c*w], gate [..., c*w]) raw projections (ape not yet added)."""
    return linear(x, p["wkv"]), linear(x, p["wgate"])


def pool(kv: jax.Array, gate: jax.Array, p: dict, positions: jax.Array, inv_freq: np.ndarray, eps: float,
         rounding=None) -> jax.Array:
    """kv, gate [..., slots, w] (gate already biased; -inf = empty slot) -> normalised, rotated entries [..., w].

    positions: [...] the entry positions (w*ratio). `rounding` (entries -> entries, None = none) is the last
    step: ``numerics="official"``'s FP8 of main entries or Hadamard + FP4 of indexer keys (`official_numerics`)."""
    weights = jax.nn.softmax(gate.astype(jnp.float32), axis=-2)
    pooled = jnp.sum(kv.astype(jnp.float32) * weights, axis=-2).astype(kv.dtype)
    entries = apply_rope(rms_norm(pooled, p["norm"], eps), positions, inv_freq)
    return entries if rounding is None else rounding(entries)


def overlap_slots(kv: jax.Array, gate: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
    """CSA slot layout for consecutive windows: kv, gate [B, n, ratio, 2w] -> [B, n, 2*ratio, w].

    Slots [0, ratio) = previous window's first half (window 0: value 0, logit -inf); slots [ratio, 2 ratio) =
    this window's second half."""
    prev_kv = jnp.pad(kv[:, :-1, :, :width], ((0, 0), (1, 0), (0, 0), (0, 0)))
    prev_gate = jnp.pad(gate[:, :-1, :, :width], ((0, 0), (1, 0), (0, 0), (0, 0)), constant_values=-jnp.inf)
    return (
        jnp.concatenate([prev_kv, kv[..., width:]], axis=-2),
        jnp.concatenate([prev_gate, gate[..., width:]], axis=-2),
    )


def compress_sequence(
    x: jax.Array, p: dict, *, ratio: int, overlap: bool, width: int, inv_freq: np.ndarray, eps: float,
    rounding=None,
) -> jax.Array:
    """Full-sequence compression from position 0: x [B, T, e] -> entries [B, T // ratio, width]."""
    b, t, _ = x.shape
    n = t // ratio
    if n == 0:
        return jnp.zeros((b, 0, width), x.dtype)
    kv, gate = project(x[:, : n * ratio], p)
    kv = kv.reshape(b, n, ratio, -1)
    gate = gate.reshape(b, n, ratio, -1) + p["ape"].astype(gate.dtype)
    if overlap:
        kv, gate = overlap_slots(kv, gate, width)
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) * ratio, (b, n))
    return pool(kv, gate, p, positions, inv_freq, eps, rounding)
