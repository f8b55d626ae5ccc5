"""Device bytes of the weights as a quantized checkpoint holds them (`ds4jax.io.stored_footprint`), from the config
alone: equal to the bytes of a model quantized for real, leaf by leaf; the mesh's memory report and ``ds4jax info``
use them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ds4jax import cli
from ds4jax.io import stored_footprint
from ds4jax.model import params as params_lib
from ds4jax.model.config import AttentionType as A, MlpType as M, flash, tiny
from ds4jax.model.handle import Model
from ds4jax.model.quantize import quantize_model
from ds4jax.model.quantized import is_quantized
from ds4jax.runtime.mesh import make_mesh

# every attention and MoE kind, and the MTP block: each quantized leaf kind appears
CFG = tiny(num_layers=3, attention_types=(A.SLIDING, A.CSA, A.HCA), mlp_types=(M.HASH, M.TOPK, M.TOPK))


@pytest.fixture(scope="module")
def model():
    params = params_lib.init(CFG, jax.random.key(0), jnp.float32)
    target = params_lib.abstract(CFG, jnp.bfloat16)
    return Model(CFG, jax.tree.map(lambda a, t: a.astype(t.dtype), params, target))


@pytest.mark.parametrize("quantized", [None, "fp8", "fp4"])
def test_leaf_bytes_equal_a_quantized_model(model, quantized):
    real = model if quantized is None else quantize_model(model, quantized)
    got = [sum(x.nbytes for x in jax.tree.leaves(leaf)) for leaf in jax.tree.leaves(real.params, is_leaf=is_quantized)]
    want = stored_footprint.leaf_bytes(CFG, jnp.bfloat16, quantized)
    assert len(got) == len(want) and got == want
    assert sum(want) == stored_footprint.weight_bytes(CFG, jnp.bfloat16, quantized)


def test_formats_order_and_the_published_flash():
    sizes = {q: stored_footprint.weight_bytes(flash(), jnp.bfloat16, q) for q in (None, "fp8", "fp4")}
    assert sizes["fp4"] < sizes["fp8"] < sizes[None]
    assert 149 * 2**30 < sizes["fp4"] < 151 * 2**30  # DeepSeek-V4-Flash's published weights, MTP included
    with pytest.raises(Exception, match="quantize"):
        stored_footprint.leaf_bytes(CFG, jnp.bfloat16, "int4")


def test_mesh_report_scales_each_shard():
    one, ep = make_mesh(), make_mesh(expert=4)
    stored = stored_footprint.weight_bytes(CFG, jnp.bfloat16, "fp4")
    assert one.memory_report(CFG, None, jnp.bfloat16, quantized="fp4")["params"] == stored
    plain = ep.memory_report(CFG, None, jnp.bfloat16)["params"]
    quant = ep.memory_report(CFG, None, jnp.bfloat16, quantized="fp4")["params"]
    assert stored / 4 <= quant < plain  # experts split four ways, the rest replicated
    # the unquantized report is the declared bytes, as before
    declared = stored_footprint.weight_bytes(CFG, jnp.bfloat16, None)
    assert one.memory_report(CFG, None, jnp.bfloat16)["params"] == declared


def test_info_prints_both(capsys):
    assert cli.main(["info", "--preset", "flash"]) == 0
    out = capsys.readouterr().out
    assert "150.0 GiB FP8 dense + FP4 experts, as published" in out and "542.0 GiB in bfloat16" in out
    assert cli.main(["info", "--preset", "tiny", "--mesh", "expert=2", "--quantized", "fp4",
                     "--device-memory", "1"]) == 0
    assert "(FP8 dense + FP4 experts, as published)" in capsys.readouterr().out


# a repeated (CSA, HCA) unit: scanned layers, whose stacked leaves the random model draws slice by slice
REPEATED = tiny(num_layers=5, attention_types=(A.SLIDING, A.CSA, A.HCA, A.CSA, A.HCA),
                mlp_types=(M.HASH, M.TOPK, M.TOPK, M.TOPK, M.TOPK))


@pytest.mark.parametrize("cfg", [CFG, REPEATED], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("quantized", ["fp8", "fp4"])
def test_random_quantized_model_is_the_quantized_random_model(quantized, cfg):
    """Built leaf by leaf (each weight drawn and quantized at once, for models too large in bf16; stacked layers
    drawn straight into their slices): the same tree and bytes as quantizing `params.init`'s model, and
    `stored_footprint`'s size."""
    from ds4jax.model import layer_stack
    from ds4jax.model.quantize import random_quantized_model

    key = jax.random.key(5)
    want = quantize_model(Model(cfg, layer_stack.for_loader(cfg, params_lib.init(cfg, key, jnp.bfloat16))), quantized)
    got = random_quantized_model(cfg, key, quantized)
    assert jax.tree.structure(got.params) == jax.tree.structure(want.params)
    for a, b in zip(jax.tree.leaves(want.params), jax.tree.leaves(got.params)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    assert sum(x.nbytes for x in jax.tree.leaves(got.params)) == stored_footprint.weight_bytes(
        cfg, jnp.bfloat16, quantized)
    if cfg is REPEATED:
        assert any(s.repeats > 1 for s in got.params["layers"].segments)
