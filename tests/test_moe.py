"""The three routed-expert strategies (ragged_dot, per-row gather, padded tiles) compute the same MoE."""

import jax
import numpy as np
import pytest

import ds4jax
from ds4jax.model import params as P
from ds4jax.model.config import MlpType
from ds4jax.model.layers import moe


@pytest.fixture(scope="module")
def setup():
    cfg = ds4jax.tiny()
    return cfg, P.init(cfg, jax.random.key(0))


@pytest.mark.parametrize("rows", [1, 5, 37])
@pytest.mark.parametrize("kind", [MlpType.TOPK, MlpType.HASH])
def test_strategies_agree(setup, rows, kind):
    cfg, params = setup
    layer = 2 if kind is MlpType.TOPK else 0
    p = params["layers"][layer]["ffn"]
    x = jax.random.normal(jax.random.key(rows), (rows, cfg.hidden_size))
    ids = jax.random.randint(jax.random.key(rows + 1), (rows,), 0, cfg.vocab_size)
    routing = moe.route(x, ids, p, cfg, kind)
    outs = {s: np.asarray(moe.routed_experts(x, routing, p["experts"], cfg, s)) for s in ("ragged", "gather", "tiles")}
    scale = np.abs(outs["ragged"]).max()
    assert scale > 0
    for s in ("gather", "tiles"):
        np.testing.assert_allclose(outs[s], outs["ragged"], atol=1e-5 * scale, rtol=0, err_msg=s)


def test_tiles_in_passes_agree(setup, monkeypatch):
    """Tiles whose gathered weights exceed TILE_PASS_BYTES run in passes (lax.map, the last pass padded): the same
    output as one pass. The budget here allows 3 tiles a pass over 37 tokens' tiles."""
    cfg, params = setup
    p = params["layers"][2]["ffn"]
    x = jax.random.normal(jax.random.key(7), (37, cfg.hidden_size))
    routing = moe.route(x, jax.numpy.zeros((37,), jax.numpy.int32), p, cfg, MlpType.TOPK)
    whole = np.asarray(moe.routed_experts(x, routing, p["experts"], cfg, "tiles"))
    per_tile = 3 * cfg.hidden_size * cfg.moe_intermediate_size * x.dtype.itemsize
    monkeypatch.setattr(moe, "TILE_PASS_BYTES", 3 * per_tile)
    jaxpr = str(jax.make_jaxpr(lambda x: moe.routed_experts(x, routing, p["experts"], cfg, "tiles"))(x))
    assert "scan" in jaxpr  # the passes really run
    passed = np.asarray(moe.routed_experts(x, routing, p["experts"], cfg, "tiles"))
    np.testing.assert_allclose(passed, whole, atol=1e-6 * np.abs(whole).max(), rtol=0)


def test_strategy_choice(monkeypatch):
    monkeypatch.delenv("DS4JAX_MOE", raising=False)
    assert moe.moe_strategy(6, 256) == "ragged"  # CPU
    monkeypatch.setenv("DS4JAX_MOE", "tiles")
    assert moe.moe_strategy(6, 256) == "tiles"
    monkeypatch.setenv("DS4JAX_MOE", "bogus")
    with pytest.raises(ValueError, match="DS4JAX_MOE"):
        moe.moe_strategy(6, 256)
