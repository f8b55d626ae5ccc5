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


def test_strategy_choice(monkeypatch):
    monkeypatch.delenv("DS4JAX_MOE", raising=False)
    assert moe.moe_strategy(6, 256) == "ragged"  # CPU
    monkeypatch.setenv("DS4JAX_MOE", "tiles")
    assert moe.moe_strategy(6, 256) == "tiles"
    monkeypatch.setenv("DS4JAX_MOE", "bogus")
    with pytest.raises(ValueError, match="DS4JAX_MOE"):
        moe.moe_strategy(6, 256)
