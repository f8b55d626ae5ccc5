"""`ds4jax.model.probe`: the per-layer view of a forward is the forward's own (same logits) and self-consistent."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ds4jax.model import params as P
from ds4jax.model.config import AttentionType, MlpType, tiny
from ds4jax.model.forward import forward_full
from ds4jax.model.layers.mhc import hc_pre
from ds4jax.model.probe import probe

T = 29  # CSA (ratio 4): 7 entries > index_topk 4, so the indexer drops some; HCA (ratio 8): 3 entries


@pytest.fixture(scope="module")
def run():
    cfg = tiny()
    params = P.init(cfg, jax.random.key(3), jnp.float32)
    ids = jax.random.randint(jax.random.key(4), (2, T), 3, cfg.vocab_size)
    logits, views = jax.jit(probe, static_argnums=0)(cfg, params, ids)
    full = jax.jit(forward_full, static_argnums=0)(cfg, params, ids)
    return cfg, params, ids, logits, views, full


def test_logits_are_the_forwards(run):
    cfg, _, _, logits, views, full = run
    assert len(views) == cfg.num_layers
    chex.assert_trees_all_close(logits, full.logits, rtol=1e-5, atol=1e-5)
    for view, aux in zip(views, full.aux):
        np.testing.assert_array_equal(view.routing.experts, aux.routing.experts)


def test_attention_weights_live_on_valid_keys(run):
    cfg, _, _, _, views, _ = run
    pos = np.arange(T)
    window = (pos[:, None] - pos[None, :] >= 0) & (pos[:, None] - pos[None, :] < cfg.sliding_window)
    for i, (kind, v) in enumerate(zip(cfg.attention_types, views)):
        probs, valid = np.asarray(v.probs), np.asarray(v.valid)
        n = probs.shape[-1] - T
        assert n == (0 if kind is AttentionType.SLIDING else T // cfg.compress_ratio_of(kind)), i
        np.testing.assert_array_equal(valid[:, :, :T], np.broadcast_to(window, (2, T, T)))
        assert np.all(probs[~np.broadcast_to(valid[:, :, None], probs.shape)] == 0), i
        total = probs.sum(-1)
        assert np.all(total <= 1 + 1e-5) and np.all(total > 0), i  # the sink takes the rest
        entries = np.asarray(v.entries)
        if kind is AttentionType.CSA:
            sel = np.asarray(v.selection)
            picked = np.zeros_like(entries)
            for b, t in np.ndindex(sel.shape[:2]):
                picked[b, t, sel[b, t][sel[b, t] >= 0]] = True
            np.testing.assert_array_equal(valid[:, :, T:], entries & picked)
            np.testing.assert_array_equal(picked.sum(-1), np.minimum(entries.sum(-1), cfg.index_topk))
            assert (entries.sum(-1) > cfg.index_topk).any()  # some queries see the indexer drop entries
        else:
            assert v.selection is None
            np.testing.assert_array_equal(valid[:, :, T:], entries)


def test_hyper_connection_weights(run):
    cfg, params, ids, _, views, full = run
    for i, v in enumerate(views):
        for hc in (v.hc_attn, v.hc_ffn):
            chex.assert_shape(hc.comb, (2, T, cfg.hc_mult, cfg.hc_mult))
            np.testing.assert_allclose(hc.comb.sum(-1), 1, atol=1e-3)
            np.testing.assert_allclose(hc.comb.sum(-2), 1, atol=1e-3)
            assert np.all(np.asarray(hc.pre) > 0) and np.all(np.asarray(hc.post) > 0)
            assert np.all(np.asarray(hc.post) < 2)
    # the attention hc weights of layer 1 are those hc_pre computes on layer 0's output streams
    x = full.hidden[0]
    post, comb, collapsed = hc_pre(x, params["layers"][1]["hc_attn"], cfg)
    chex.assert_trees_all_close((post, comb), (views[1].hc_attn.post, views[1].hc_attn.comb), atol=1e-6)
    chex.assert_trees_all_close(collapsed, jnp.sum(views[1].hc_attn.pre[..., None] * x, -2), atol=1e-5)


def test_routing_kinds(run):
    cfg, params, ids, _, views, _ = run
    flat = np.asarray(ids).reshape(-1)
    for kind, p, v in zip(cfg.mlp_types, params["layers"], views):
        if kind is MlpType.HASH:
            np.testing.assert_array_equal(v.routing.experts, np.asarray(p["ffn"]["tid2eid"])[flat])
        chex.assert_shape(v.routing.experts, (2 * T, cfg.num_experts_per_tok))
