"""Acceptance rules for speculative decoding: exact match (greedy) and rejection sampling.

Rejection sampling (Leviathan et al. / Chen et al.) keeps the target distribution exactly: draft token d_j ~ q_j
is accepted with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection the replacement is drawn from
the residual norm(max(0, p_j - q_j)); if all k drafts are accepted a bonus token is drawn from p_k.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Acceptance(NamedTuple):
    accepted: jax.Array  # [b] int32 number of accepted draft tokens a in [0, k]
    next_token: jax.Array  # [b] int32 the target's token after the accepted prefix (correction or bonus)


def accept_greedy(drafts: jax.Array, target_logits: jax.Array, limit: jax.Array | None = None) -> Acceptance:
    """drafts [b, k], target_logits [b, k+1, v]: accept the longest prefix equal to the target's argmax.

    limit [b] (optional): accept at most limit[b] drafts (a request speculating with fewer than k)."""
    return accept_choices(drafts, jnp.argmax(target_logits, axis=-1).astype(jnp.int32), limit)


def accept_choices(drafts: jax.Array, choice: jax.Array, limit: jax.Array | None = None) -> Acceptance:
    """`accept_greedy` from the target's argmax tokens `choice` [b, k+1] (a caller that needs them too computes
    them once)."""
    match = drafts == choice[:, :-1]
    if limit is not None:
        match = match & (jnp.arange(drafts.shape[1])[None, :] < limit[:, None])
    accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)
    return Acceptance(accepted, jnp.take_along_axis(choice, accepted[:, None], axis=1)[:, 0])


def accept_sampled(drafts: jax.Array, draft_logp: jax.Array, target_logp: jax.Array, key: jax.Array,
                   limit: jax.Array | None = None) -> Acceptance:
    """Rejection sampling.

    drafts [b, k]; draft_logp [b, k, v] log q_j (the filtered distributions the drafts were drawn from);
    target_logp [b, k+1, v] log p_j (filtered with the same temperature / top-p); key [b] typed keys.
    limit [b] (optional): drafts j >= limit[b] are not proposals at all (q := 0 there, so the token after
    limit[b] accepted drafts is drawn from p itself, the bonus rule)."""
    b, k = drafts.shape
    p = jnp.exp(target_logp)
    q = jnp.exp(draft_logp)
    proposed = jnp.ones((b, k), bool) if limit is None else jnp.arange(k)[None, :] < limit[:, None]
    q = jnp.where(proposed[..., None], q, 0.0)
    p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    keys = jax.vmap(lambda kk: jax.random.split(kk, 2))(key)
    u = jax.vmap(lambda kk: jax.random.uniform(kk, (k,)))(keys[:, 0])
    ok = (u * q_d < p_d) & proposed  # accept with probability min(1, p/q); q_d > 0 since d was drawn from q
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)
    # residual at the first rejection; the bonus distribution p_k when everything was accepted
    q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # q_k := 0 so the "residual" is p_k itself
    p_a = jnp.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]
    q_a = jnp.take_along_axis(q_pad, accepted[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_a - q_a, 0.0)
    # if p == q exactly the residual is empty; any draw from p is then correct
    residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_a)
    nxt = jax.vmap(jax.random.categorical)(keys[:, 1], jnp.log(residual)).astype(jnp.int32)
    return Acceptance(accepted, nxt)
