"""RMSNorm variants (spec §3.1): statistics in float32, one cast back to the input dtype."""

import math

import jax
import jax.numpy as jnp

PAIR_PIECES = 8  # `rms_norm_pair` cuts both rows into at most this many equal pieces, else it runs two norms


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Weighted RMSNorm; the (float32) weight multiplies in float32 before the single cast."""
    return _normalized(x, weight, jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True), eps)


def _normalized(x: jax.Array, weight: jax.Array, mean_square: jax.Array, eps: float) -> jax.Array:
    """x times the reciprocal RMS from its `mean_square` [..., 1] (float32), then the weight, then one cast."""
    x32 = x.astype(jnp.float32) * jax.lax.rsqrt(mean_square + eps)
    return (weight.astype(jnp.float32) * x32).astype(x.dtype)


def unweighted_rms_norm(x: jax.Array, eps: float) -> jax.Array:
    """Per-head query norm: the reciprocal RMS is computed in float32, cast, then multiplied (as HF does)."""
    inv = jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True) + eps)
    return x * inv.astype(x.dtype)


def rms_norm_pair(a: jax.Array, wa: jax.Array, b: jax.Array, wb: jax.Array, eps: float
                  ) -> tuple[jax.Array, jax.Array]:
    """`rms_norm(a, wa)`, `rms_norm(b, wb)` for two vectors of one token (the query latent and the K=V vector,
    projected from the same input), their sums of squares from one reduction: both rows are cut into pieces of
    gcd(len a, len b) values, each piece reduced (one kernel over both), and a's and b's pieces added up as
    elementwise sums, which XLA fuses into the consumers. At decode batch 1 each norm's reduction was a kernel
    launch of its own (two a layer, `scripts/step_kernels.py`); the same sums, added in another order (float32).

    One token only: with several rows XLA splits the two projections' merged GEMM along k, and the concatenation
    here then kept the split's sum as a kernel of its own where the two reductions had taken it in (decode at 8
    rows and verify at 4 tokens: one launch more a layer); there the two norms run as before."""
    la, lb = a.shape[-1], b.shape[-1]
    g = math.gcd(la, lb)
    if a.shape[:-1] != b.shape[:-1] or math.prod(a.shape[:-1]) != 1 or (la + lb) // g > PAIR_PIECES:
        return rms_norm(a, wa, eps), rms_norm(b, wb, eps)
    both = jnp.concatenate([a.astype(jnp.float32), b.astype(jnp.float32)], axis=-1)
    pieces = jnp.sum(jnp.square(both.reshape(*both.shape[:-1], (la + lb) // g, g)), axis=-1)

    def mean_square(first, count, length):
        return sum(pieces[..., i:i + 1] for i in range(first, first + count)) / length

    return (_normalized(a, wa, mean_square(0, la // g, la), eps),
            _normalized(b, wb, mean_square(la // g, lb // g, lb), eps))
