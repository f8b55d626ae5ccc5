"""scripts/layer_check.py: the kernels against the reference kernels one layer at a time, on the same inputs.

On a tiny scanned model in the published format (FP8 dense + FP4 experts) through the interpreted kernels, every
layer and the logits agree; with the FP8 matmul kernel made wrong (its output scaled by 1.5), the layers whose
linears it serves fail and the check names them, while the comparison of outputs alone would only say "wrong".
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import layer_check  # noqa: E402
from ds4jax.model import params as params_lib  # noqa: E402
from ds4jax.model.config import AttentionType as A, MlpType as M, tiny  # noqa: E402
from ds4jax.model.handle import Model  # noqa: E402
from ds4jax.model.quantize import quantize_model  # noqa: E402

CFG = tiny(num_layers=5, attention_types=(A.SLIDING,) + (A.HCA, A.CSA) * 2, mlp_types=(M.HASH,) + (M.TOPK,) * 4)


@pytest.fixture(scope="module")
def model():
    m = quantize_model(Model(CFG, params_lib.init(CFG, jax.random.key(3), jnp.float32)))
    assert any(seg.repeats == 2 for seg in m.params["layers"].segments)  # scanned (DS4JAX_SCAN_MIN_REPEATS=2)
    return m


def _check(model, decode=True, on_layer=None):
    prompt = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 16)).astype(np.int32)  # two chunks of 8
    return layer_check.check_layers(model, "pallas_interpret", rows=2, ctx=16, chunk=8, token=7, prompt=prompt,
                                    max_context=64, max_slots=2, dtype="float32", decode=decode, on_layer=on_layer)


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_every_layer_agrees(model, decode):
    seen = []
    res = _check(model, decode, on_layer=seen.append)
    assert [r["layer"] for r in res["layers"]] == list(range(CFG.num_layers))
    assert [r["layer"] for r in seen] == list(range(CFG.num_layers)) and all(r["seconds"] > 0 for r in seen)
    assert res["failures"] == [] and res["worst"] > 0.9999, res
    # one program per layer kind and step shape and kernel set: the first and last layers share their kind's (the
    # embedding and the head run outside them); both tests together: 3 kinds x {8, 1} tokens x 2 kernel sets at most
    kinds = set(zip(CFG.attention_types, CFG.mlp_types))
    assert layer_check._layer_step._cache_size() <= len(kinds) * 4, layer_check._layer_step._cache_size()


def test_a_wrong_kernel_fails_in_its_layers(model, monkeypatch):
    import pallas_kernels

    right = pallas_kernels.fp8_matmul
    monkeypatch.setattr(pallas_kernels, "fp8_matmul", lambda *a, **k: right(*a, **k) * 1.5)
    jax.clear_caches()
    try:
        res = _check(model)
    finally:
        jax.clear_caches()
    failed = {f.split(":")[0] for f in res["failures"]}
    assert {f"layer {i}" for i in range(CFG.num_layers)} <= failed, res["failures"]


def test_a_cosine_that_is_not_a_number_fails():
    """An all-zero side (cosine 0/0) or a non-finite one scores -1: below any threshold, never a pass."""
    zeros, ones = np.zeros((2, 8)), np.ones((2, 8))
    with np.errstate(invalid="ignore", divide="ignore"):
        assert layer_check._score(layer_check.compare(zeros, zeros)) == -1.0
    assert layer_check._score(layer_check.compare(np.full((2, 8), np.nan), ones)) == -1.0
    assert layer_check._score(layer_check.compare(ones, ones)) == pytest.approx(1.0)
