"""The mHC pre-step — the specification (pure jnp; ds4jax's `mhc.hc_pre` / `mhc.hc_head` then `rms_norm`).

Per token, with X [m, e] its residual streams and mix = flat(X) @ fn the projection of the *unnormalised*
streams (the caller's matmul; the reciprocal RMS rho is a per-token scalar, so it is applied here instead):
  rho  = rsqrt(mean(X^2) + rms_eps)                   over all m * e values
  pre  = sigmoid(rho * mix[:m] * scale[0] + base[:m]) + hc_eps
  post = 2 sigmoid(rho * mix[m:2m] * scale[1] + base[m:2m])                      (layers only)
  comb = sinkhorn(rho * mix[2m:] * scale[2] + base[2m:], as [m, m]; iters, hc_eps)  (layers only)
  collapsed = sum_j pre_j X_j, cast to X's dtype;  out = rms_norm(collapsed, norm_weight, rms_eps)
The final hyper-connection before the head (`head=True`) has mix [m], scale [1], base [m] and only `out`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.sinkhorn.reference import sinkhorn_reference


def mhc_pre_reference(mix, x, scale, base, norm_weight, *, iters: int, hc_eps: float, rms_eps: float,
                      head: bool = False, layer=None, block_sizes=None, interpret=False):
    """mix [..., n] f32, x [..., m, e] -> (post [..., m] f32, comb [..., m, m] f32, out [..., e] x.dtype);
    `head`: out only. `layer`: scale / base / norm_weight are stacks, and their layer `layer` is used."""
    del block_sizes, interpret
    if layer is not None:
        scale, base, norm_weight = (jax.lax.dynamic_index_in_dim(a, layer, keepdims=False)
                                    for a in (scale, base, norm_weight))
    m = x.shape[-2]
    x32 = x.astype(jnp.float32)
    rho = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=(-2, -1)) + rms_eps)[..., None]
    mix = mix.astype(jnp.float32) * rho
    scale, base = scale.astype(jnp.float32), base.astype(jnp.float32)
    pre = jax.nn.sigmoid(mix[..., :m] * scale[0] + base[:m]) + hc_eps
    collapsed = jnp.sum(pre[..., None] * x32, axis=-2).astype(x.dtype)
    c32 = collapsed.astype(jnp.float32)
    c32 = c32 * jax.lax.rsqrt(jnp.mean(jnp.square(c32), axis=-1, keepdims=True) + rms_eps)
    out = (norm_weight.astype(jnp.float32) * c32).astype(x.dtype)
    if head:
        return out
    post = 2 * jax.nn.sigmoid(mix[..., m:2 * m] * scale[1] + base[m:2 * m])
    logits = (mix[..., 2 * m:] * scale[2] + base[2 * m:]).reshape(mix.shape[:-1] + (m, m))
    return post, sinkhorn_reference(logits, iters=iters, eps=hc_eps), out
