"""Manifold-constrained hyper-connections (spec §3.2): N residual streams mixed by Sinkhorn-projected weights.

X has shape [..., m, e]. All mixing weights are float32; the sub-layer input is cast to X's dtype.
"""

import jax
import jax.numpy as jnp

from ds4jax.model.config import Config
from ds4jax.model.layers.norms import rms_norm


def _mixes(x: jax.Array, fn: jax.Array, eps: float) -> jax.Array:
    """rho * (fn x_flat) with rho the reciprocal RMS over all m*e values: [..., outputs] float32 (fn [outputs,
    m*e], as the checkpoint stores it)."""
    flat = x.reshape(x.shape[:-2] + (-1,)).astype(jnp.float32)
    flat = flat * jax.lax.rsqrt(jnp.mean(jnp.square(flat), axis=-1, keepdims=True) + eps)
    return jnp.einsum("...i,oi->...o", flat, fn.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def raw_mixes(x: jax.Array, fn: jax.Array) -> jax.Array:
    """fn x_flat without the reciprocal RMS (a per-token scalar the fused kernel applies after the matmul):
    [..., outputs] float32. A plain einsum, also for one token: fn's few outputs (2m + m*m) make XLA:GPU's
    strength-reduced form (multiply + reduce, no [in, out] product written) faster than `linear`'s two-row GEMM
    (H100, Flash dims, one token: 3.0 against 4.7 us with its pad; `scripts/bench_mhc.py`). fn is [outputs, m*e],
    the checkpoint's own layout: the reduction runs along its rows, one kernel; with fn as [m*e, outputs] (ds4jax's
    layout before session 31) it was a column reduction, which XLA:GPU splits in two kernels (one launch more per
    call, two calls a layer at decode; `scripts/step_kernels.py`: flash_slice(4) decode 190 -> 181)."""
    flat = x.reshape(x.shape[:-2] + (-1,)).astype(jnp.float32)
    return jnp.einsum("...i,oi->...o", flat, fn.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def sinkhorn(logits: jax.Array, iters: int, eps: float) -> jax.Array:
    """Row softmax + eps, column normalise, then (iters-1) x (row, column) normalisations. [..., m, m].

    The specification, kept by the cache-free `forward` (HF parity, training: differentiable) and by the steps
    under the reference kernels (CPU, TPU). The pooled GPU steps run the whole pre-step in one Pallas kernel
    (`pallas_kernels.mhc_pre`, via `ds4jax.runtime.kernels.mhc_pre`), whose Sinkhorn is an in-kernel loop. As
    an XLA `fori_loop` on a GPU each of the iters-1 steps costs a few small kernel launches (twice a layer: decode
    was launch-bound on the H200), and unrolled, XLA's GPU compiler needs minutes for a decode loop (H200, jax
    0.11.2: the engine's `decode_loop` of the tiny config did not finish compiling in 80 s, against 8 s as a
    loop); on CPU the unrolled form made the default model's decode-step compile ~3x
    slower and its executables ~2000 kernels larger. Hence a loop here."""
    rows = lambda c: jnp.sum(c, axis=-1, keepdims=True)  # noqa: E731
    cols = lambda c: jnp.sum(c, axis=-2, keepdims=True)  # noqa: E731
    comb = jax.nn.softmax(logits, axis=-1) + eps
    comb = comb / (cols(comb) + eps)

    def step(_, c):
        c = c / (rows(c) + eps)
        return c / (cols(c) + eps)

    return jax.lax.fori_loop(0, iters - 1, step, comb)


def hc_weights(x: jax.Array, p: dict, cfg: Config) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The token's mixing weights, float32: (pre [..., m], post [..., m], comb [..., m, m] doubly stochastic)."""
    m = cfg.hc_mult
    mix = _mixes(x, p["fn"], cfg.rms_norm_eps)
    scale, base = p["scale"].astype(jnp.float32), p["base"].astype(jnp.float32)
    pre = jax.nn.sigmoid(mix[..., :m] * scale[0] + base[:m]) + cfg.hc_eps
    post = 2 * jax.nn.sigmoid(mix[..., m : 2 * m] * scale[1] + base[m : 2 * m])
    comb_logits = mix[..., 2 * m :] * scale[2] + base[2 * m :]
    comb = sinkhorn(comb_logits.reshape(comb_logits.shape[:-1] + (m, m)), cfg.hc_sinkhorn_iters, cfg.hc_eps)
    return pre, post, comb


def hc_pre(x: jax.Array, p: dict, cfg: Config) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns (post [..., m], comb [..., m, m], collapsed sub-layer input [..., e])."""
    pre, post, comb = hc_weights(x, p, cfg)
    collapsed = jnp.sum(pre[..., None] * x.astype(jnp.float32), axis=-2).astype(x.dtype)
    return post, comb, collapsed


def hc_pre_normed(x: jax.Array, p: dict, norm_weight: jax.Array, cfg: Config):
    """`hc_pre` then the sub-layer's RMSNorm: (post, comb, normalised sub-layer input [..., e]). The pooled GPU
    steps replace this pair by one kernel (`ds4jax.runtime.kernels.mhc_pre`)."""
    post, comb, collapsed = hc_pre(x, p, cfg)
    return post, comb, rms_norm(collapsed, norm_weight, cfg.rms_norm_eps)


def hc_post(y: jax.Array, x: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """X'_k = post_k * y + sum_j comb[j, k] X_j (input stream j is the row index), in float32, one cast.

    The m-term sum is written as a broadcast product summed over j, not an einsum: XLA:GPU made the einsum a GEMM
    kernel of its own beside the elementwise one (two launches a call, twice a layer, at decode); as a sum the
    whole update is one loop fusion."""
    mixed = jnp.sum(comb[..., :, :, None] * x.astype(jnp.float32)[..., :, None, :], axis=-3)
    return (post[..., None] * y.astype(jnp.float32)[..., None, :] + mixed).astype(x.dtype)


def hc_head(x: jax.Array, p: dict, cfg: Config) -> jax.Array:
    """Final stream reduction (no Sinkhorn, no post): [..., m, e] -> [..., e]."""
    mix = _mixes(x, p["fn"], cfg.rms_norm_eps)
    pre = jax.nn.sigmoid(mix * p["scale"].astype(jnp.float32) + p["base"].astype(jnp.float32)) + cfg.hc_eps
    return jnp.sum(pre[..., None] * x.astype(jnp.float32), axis=-2).astype(x.dtype)


def hc_head_normed(x: jax.Array, p: dict, norm_weight: jax.Array, cfg: Config) -> jax.Array:
    """`hc_head` then the final RMSNorm: [..., m, e] -> [..., e]. The pooled GPU steps replace this pair by one
    kernel (`ds4jax.runtime.kernels.mhc_head`)."""
    return rms_norm(hc_head(x, p, cfg), norm_weight, cfg.rms_norm_eps)
