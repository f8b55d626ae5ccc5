"""Attention with one shared K=V head, sink, sliding window and compressed entries (spec §3.4-§3.8).

Pieces shared by the full-sequence forward and the pooled steps:
`project_qkv` (query latent, normalised rotated queries, the rotated K=V vector), `attend` (dense masked
softmax with the sink in the denominator; a reference for the Pallas kernel), `output_projection` (inverse
RoPE at the query position, grouped low-rank projection). `attention_sequence` is the cache-free forward.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.model.config import AttentionType, Config
from ds4jax.model.layers import compressor, indexer
from ds4jax.model import official_numerics as numerics
from ds4jax.model.layers.linear import grouped_f32, linear
from ds4jax.model.layers.norms import rms_norm, rms_norm_pair, unweighted_rms_norm
from ds4jax.model.layers.rope import apply_rope, inv_frequencies


def layer_inv_freq(cfg: Config, kind: AttentionType) -> np.ndarray:
    return inv_frequencies(cfg, compressed=kind is not AttentionType.SLIDING)


def project_qkv(x: jax.Array, positions: jax.Array, p: dict, cfg: Config, inv_freq: np.ndarray):
    """x [b, t, e] -> (q_latent [b, t, l], q [b, t, h, d], kv [b, t, d]).

    Under ``numerics="official"`` the inputs of the FP8 linears and kv's non-rope dims are rounded
    (`official_numerics`); q_latent is returned unrounded (the indexer's wq_b rounds its own input)."""
    xq = numerics.round_act(x, cfg)
    q_raw, kv_raw = linear(xq, p["wq_a"]), linear(xq, p["wkv"])
    if isinstance(p["wq_a"], jax.Array) and isinstance(p["wkv"], jax.Array):
        # XLA's own dots, which it merges into one GEMM: the pair's concatenation is that GEMM's output
        q_latent, kv = rms_norm_pair(q_raw, p["q_norm"], kv_raw, p["kv_norm"], cfg.rms_norm_eps)
    else:
        # kernels' outputs (FP8 weights, a scanned layer's weights read in their stacks): two buffers, which the
        # pair's concatenation would copy (one launch more a layer: `scripts/step_kernels.py`, published format)
        q_latent = rms_norm(q_raw, p["q_norm"], cfg.rms_norm_eps)
        kv = rms_norm(kv_raw, p["kv_norm"], cfg.rms_norm_eps)
    q = linear(numerics.round_act(q_latent, cfg), p["wq_b"])
    q = q.reshape(x.shape[:-1] + (cfg.num_heads, cfg.head_dim))
    q = apply_rope(unweighted_rms_norm(q, cfg.rms_norm_eps), positions, inv_freq)
    kv = apply_rope(kv, positions, inv_freq)
    return q_latent, q, numerics.round_kv(kv, cfg)


def attention_probs(q: jax.Array, keys: jax.Array, valid: jax.Array, sink: jax.Array, scale: float) -> jax.Array:
    """float32 [b, t, h, s]: p_j = exp(l_j) / (sum_valid exp(l) + exp(sink_h)), 0 for invalid keys.

    Each row sums to 1 minus the sink's share (0 for a query with no valid key)."""
    logits = jnp.einsum("bthd,bsd->bths", q, keys, preferred_element_type=jnp.float32,
                        precision=jax.lax.Precision.HIGHEST) * scale
    logits = jnp.where(valid[:, :, None, :], logits, -jnp.inf)
    sink = sink.astype(jnp.float32)[None, None, :]
    peak = jnp.maximum(jnp.max(logits, axis=-1), sink)  # [b, t, h]
    probs = jnp.exp(logits - peak[..., None])
    denom = jnp.sum(probs, axis=-1) + jnp.exp(sink - peak)
    return probs / denom[..., None]


def attend(q: jax.Array, keys: jax.Array, valid: jax.Array, sink: jax.Array, scale: float) -> jax.Array:
    """q [b, t, h, d], keys [b, s, d] (K = V), valid [b, t, s] bool, sink [h] -> [b, t, h, d].

    Weights from `attention_probs`; a query with no valid key returns 0. Invalid keys must hold finite values
    (callers zero them): masked logits are -inf, so they get probability 0."""
    probs = attention_probs(q, keys, valid, sink, scale).astype(keys.dtype)
    out = jnp.einsum("bths,bsd->bthd", probs, keys, preferred_element_type=jnp.float32,
                     precision=jax.lax.Precision.HIGHEST)
    return out.astype(q.dtype)


def output_projection(o: jax.Array, positions: jax.Array, p: dict, cfg: Config, inv_freq: np.ndarray) -> jax.Array:
    """o [b, t, h, d] -> [b, t, e]: conjugate RoPE at the query position, then the grouped projection."""
    o = apply_rope(o, positions, inv_freq, inverse=True)
    b, t = o.shape[:2]
    # heads of group k are contiguous; group-major layout ("gni,gio") is a batched matmul every backend supports
    grouped = o.reshape(b * t, cfg.o_groups, -1).transpose(1, 0, 2)
    z = grouped_f32(grouped, p["wo_a"])
    return linear(numerics.round_act(z.astype(o.dtype).transpose(1, 0, 2).reshape(b, t, -1), cfg), p["wo_b"])


def sliding_mask(q_pos: jax.Array, k_pos: jax.Array, window: int) -> jax.Array:
    """[..., t, s]: key position in (q - window, q]."""
    delta = q_pos[..., :, None] - k_pos[..., None, :]
    return (delta >= 0) & (delta < window)


class SequenceKeys(NamedTuple):
    """What each query of a cache-free sequence may attend to (keys = [the t positions ; n compressed entries])."""

    positions: jax.Array  # [b, t] int32
    q: jax.Array  # [b, t, h, d] rotated queries
    keys: jax.Array  # [b, t + n, d] K = V rows: the sequence's own kv, then the compressed entries
    valid: jax.Array  # [b, t, t + n] bool: sliding window, then causal entries (CSA: only the indexer's picks)
    selection: jax.Array | None  # [b, t, k] int32 indexer picks (-1 = none) for CSA, else None


def attention_sequence(x: jax.Array, p: dict, cfg: Config, kind: AttentionType):
    """Cache-free attention over a whole sequence starting at position 0.

    x [b, t, e] (normalised). Returns (y [b, t, e], indexer selection [b, t, n] int32 or None)."""
    s = sequence_keys(x, p, cfg, kind)
    o = attend(s.q, s.keys, s.valid, p["sink"], cfg.head_dim**-0.5)
    return output_projection(o, s.positions, p, cfg, layer_inv_freq(cfg, kind)), s.selection


def sequence_keys(x: jax.Array, p: dict, cfg: Config, kind: AttentionType) -> SequenceKeys:
    """Queries, keys and the attention mask of `attention_sequence` (x [b, t, e] normalised)."""
    b, t, _ = x.shape
    inv_freq = layer_inv_freq(cfg, kind)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    q_latent, q, kv = project_qkv(x, positions, p, cfg, inv_freq)
    keys, valid = kv, sliding_mask(positions, positions, cfg.sliding_window)
    selection = None
    if kind is not AttentionType.SLIDING:
        ratio = cfg.compress_ratio_of(kind)
        entries = compressor.compress_sequence(
            x, p["compressor"], ratio=ratio, overlap=kind is AttentionType.CSA, width=cfg.head_dim,
            inv_freq=inv_freq, eps=cfg.rms_norm_eps, rounding=kv_rounding(cfg))
        n = entries.shape[1]
        causal = jnp.arange(n)[None, None, :] < ((positions + 1) // ratio)[..., None]  # [b, t, n]
        if kind is AttentionType.CSA:
            selection = csa_select(x, q_latent, positions, p["indexer"], cfg, inv_freq, causal)
            chosen = jnp.zeros((b, t, n + 1), bool)
            chosen = jax.vmap(jax.vmap(lambda row, sel: row.at[jnp.where(sel < 0, n, sel)].set(True)))(
                chosen, selection)[..., :n]
            causal = causal & chosen
        keys = jnp.concatenate([keys, entries], axis=1)
        valid = jnp.concatenate([valid, causal], axis=-1)
    return SequenceKeys(positions, q, keys, valid, selection)


def kv_rounding(cfg: Config):
    """What a main compressor applies to its entries (`compressor.pool`'s `rounding`)."""
    return lambda entries: numerics.round_kv(entries, cfg)


def index_rounding(cfg: Config):
    """What the indexer's compressor applies to its keys."""
    return lambda keys: numerics.round_index(keys, cfg)


def csa_select(x, q_latent, positions, p, cfg: Config, inv_freq, causal) -> jax.Array:
    """Indexer top-k for a whole sequence: [b, t, min(index_topk, n)] entry ids (-1 = none)."""
    keys = compressor.compress_sequence(
        x, p["compressor"], ratio=cfg.csa_ratio, overlap=True, width=cfg.index_head_dim, inv_freq=inv_freq,
        eps=cfg.rms_norm_eps, rounding=index_rounding(cfg))
    if keys.shape[1] == 0:
        return jnp.zeros(positions.shape + (0,), jnp.int32)
    q, weights = indexer.queries(q_latent, x, positions, p, cfg, inv_freq)
    return indexer.select(indexer.scores(q, weights, keys, cfg), causal, cfg.index_topk)
