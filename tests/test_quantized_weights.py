"""Quantized weights on the device (issue 26 item 1): `ds4jax.load(..., weights="checkpoint")` keeps the published
FP8 / FP4 bytes (`QuantizedWeight`), the linears and the MoE dispatch consume them, FNUZ on MI300.

The fixture is the official-layout random model of `test_official_checkpoint.py` (FP8 dense with 128x128 blocks,
FP4 experts). Quantized and dequantized loads hold the same values, so in float32 they agree to rounding.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import ds4jax
import pallas_kernels
from ds4jax.io import checkpoint, quant_formats as qf
from ds4jax.io.official_random import write_official_random
from ds4jax.model.config import MlpType
from ds4jax.model.layers import moe
from ds4jax.model.layers.linear import linear
from ds4jax.model.quantize import quantize_model
from ds4jax.model.quantized import Format, QuantizedWeight, dense
from ds4jax.runtime import kernels, routed_experts
from ds4jax.runtime.target import Target


@pytest.fixture(scope="module")
def source_and_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("official_q"))
    return write_official_random(directory, seed=7), directory


@pytest.fixture(scope="module")
def official(source_and_dir):
    return source_and_dir[1]


@pytest.fixture(scope="module")
def both(official):
    return (ds4jax.load(official, jnp.float32, weights="checkpoint"),
            ds4jax.load(official, jnp.float32, weights="bf16"))


def test_checkpoint_mode_keeps_the_stored_bytes(both):
    quantized, plain = both
    layer = quantized.params["layers"][1]
    wq_a, w2 = layer["attn"]["wq_a"], layer["ffn"]["experts"]["w2"]
    assert wq_a.format is Format.FP8 and wq_a.values.dtype == jnp.float8_e4m3fn and wq_a.block == (128, 128)
    assert w2.format is Format.FP4 and w2.values.dtype == jnp.uint8 and w2.scales.dtype == jnp.uint8
    cfg = quantized.config
    assert w2.values.shape == (cfg.num_routed_experts, cfg.moe_intermediate_size // 2, cfg.hidden_size)
    assert w2.shape == plain.params["layers"][1]["ffn"]["experts"]["w2"].shape
    assert not isinstance(layer["attn"]["wo_a"], QuantizedWeight)  # regrouped: dequantized, as upstream does
    assert not isinstance(layer["ffn"]["gate"], QuantizedWeight)  # stored BF16
    # every quantized leaf dequantizes to exactly the "bf16"-mode value (float32 here)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(
            quantized.params, is_leaf=lambda x: isinstance(x, QuantizedWeight))[0], jax.tree.leaves(plain.params)):
        np.testing.assert_array_equal(np.asarray(dense(a, jnp.float32)), np.asarray(b),
                                      err_msg=jax.tree_util.keystr(path))
    stored = sum(x.nbytes for x in jax.tree.leaves(quantized.params))
    assert stored < 0.5 * sum(x.nbytes for x in jax.tree.leaves(plain.params))


def test_quantized_model_generates_like_the_dequantized_one(both):
    quantized, plain = both
    prompt = [3, 14, 15, 92, 65]
    new = ds4jax.greedy_generate(quantized, prompt, 6)  # the pooled prefill and decode steps on QuantizedWeights
    ids = np.asarray([prompt + new[:-1]])
    logits = ds4jax.forward_logits(plain, ids)
    np.testing.assert_allclose(np.asarray(ds4jax.forward_logits(quantized, ids)), np.asarray(logits),
                               rtol=1e-5, atol=1e-5)
    assert np.argmax(np.asarray(logits)[0, len(prompt) - 1:], -1).tolist() == new  # teacher-forced greedy


def test_weights_mode_defaults_and_errors(official, monkeypatch):
    assert checkpoint.weights_mode(None) == "bf16"  # CPU: dequantize
    monkeypatch.setattr(checkpoint, "device_target", lambda: Target("cuda", "sm90"))
    assert checkpoint.weights_mode(None) == "checkpoint"
    assert checkpoint.weights_mode(None, mesh=object()) == "bf16"
    with pytest.raises(ds4jax.errors.ArgumentError, match="weights"):
        ds4jax.load(official, jnp.float32, weights="fp8")
    with pytest.raises(ds4jax.errors.ArgumentError, match="mesh"):
        checkpoint.weights_mode("checkpoint", mesh=object())


def test_save_of_a_quantized_model_writes_its_values(both, tmp_path):
    quantized, plain = both
    ds4jax.save(quantized, tmp_path / "st")
    again = ds4jax.load(tmp_path / "st", jnp.float32)
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(plain.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_quantizing_on_the_device_gives_the_checkpoint_bytes(source_and_dir, both):
    """`quantize_model` (jnp, on the params as they are, stacked) == the host quantizers' checkpoint, loaded."""
    source, _ = source_and_dir
    on_device = quantize_model(source, "fp4")
    is_q = lambda x: isinstance(x, QuantizedWeight)  # noqa: E731
    got = jax.tree_util.tree_flatten_with_path(on_device.params, is_leaf=is_q)[0]
    want = jax.tree.leaves(both[0].params, is_leaf=is_q)
    assert len(got) == len(want)
    for (path, a), b in zip(got, want):
        assert is_q(a) == is_q(b), jax.tree_util.keystr(path)
        if is_q(a):
            assert (a.format, a.block) == (b.format, b.block)
            for x, y in ((a.values, b.values), (a.scales, b.scales)):
                np.testing.assert_array_equal(np.asarray(x).view(np.uint8) if x.dtype.itemsize == 1 else x,
                                              np.asarray(y).view(np.uint8) if y.dtype.itemsize == 1 else y,
                                              err_msg=jax.tree_util.keystr(path))


# ---- FP8 dense linears --------------------------------------------------------------------------------------------

def test_fp8_linear_with_ragged_blocks_matches_the_dequantized_weight():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((100, 70)) * np.exp2(rng.integers(-4, 4, (100, 70)))).astype(np.float32)  # [out, in]
    q, s = qf.quantize_fp8(w, (32, 16))  # 4 x 5 blocks, the last ones partial
    qw = QuantizedWeight(jnp.asarray(q.T.view(ml_dtypes.float8_e4m3fn)), jnp.asarray(qf.e8m0_to_float(s).T),
                         Format.FP8, (16, 32))
    exact = qf.dequant_fp8(q, qf.e8m0_to_float(s), (32, 16)).T  # [in, out]
    np.testing.assert_array_equal(np.asarray(qw.dequantize()), exact)
    x = jnp.asarray(rng.standard_normal((3, 70)), jnp.float32)
    np.testing.assert_allclose(np.asarray(jax.jit(linear)(x, qw)), np.asarray(x) @ exact, rtol=1e-5, atol=1e-4)


# ---- FNUZ (MI300) -------------------------------------------------------------------------------------------------

def test_ocp_to_fnuz_is_exact_and_the_factor_of_two_pitfall():
    ocp = np.arange(256, dtype=np.uint8)
    ocp_values = ocp.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = np.isfinite(ocp_values)
    fnuz, scale = qf.ocp_to_fnuz(ocp, np.ones((1,), np.float32))
    assert scale[0] == 2
    fnuz_values = fnuz.view(ml_dtypes.float8_e4m3fnuz).astype(np.float32)
    np.testing.assert_array_equal(fnuz_values[finite] * scale[0], ocp_values[finite])
    assert np.isnan(fnuz_values[~finite]).all()  # OCP NaN stays NaN; OCP -0 (0x80, FNUZ NaN) became +0
    assert fnuz[0x80] == 0
    # the pitfall: OCP bytes read as FNUZ are half the value
    naive = ocp.view(ml_dtypes.float8_e4m3fnuz).astype(np.float32)
    nonzero = finite & (ocp_values != 0)
    np.testing.assert_array_equal(naive[nonzero] * 2, ocp_values[nonzero])


def test_gfx942_loads_fnuz_with_the_same_values(official, both, monkeypatch):
    assert Target("rocm", "gfx942").fp8_dtype == jnp.float8_e4m3fnuz
    assert Target("rocm", "gfx950").fp8_dtype == Target("cuda", "sm90").fp8_dtype == jnp.float8_e4m3fn
    monkeypatch.setattr(checkpoint, "device_target", lambda: Target("rocm", "gfx942"))
    mi300 = ds4jax.load(official, jnp.float32, weights="checkpoint")
    wq_b = mi300.params["layers"][0]["attn"]["wq_b"]
    ocp = both[0].params["layers"][0]["attn"]["wq_b"]
    assert wq_b.values.dtype == jnp.float8_e4m3fnuz
    np.testing.assert_array_equal(np.asarray(wq_b.scales), 2 * np.asarray(ocp.scales))
    np.testing.assert_array_equal(np.asarray(wq_b.dequantize()), np.asarray(ocp.dequantize()))


# ---- the MoE dispatch ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl, strategy", [(kernels.Impl.PALLAS_INTERPRET, None), (kernels.Impl.REFERENCE, "gather"),
                                            (kernels.Impl.REFERENCE, "tiles"), (kernels.Impl.REFERENCE, "ragged")])
@pytest.mark.parametrize("tokens", [(2, 5), (4, 9)], ids=["gemv", "tiles"])
def test_moe_dispatch_reads_fp4_experts(both, impl, strategy, tokens, monkeypatch):
    """Under the kernels, FP4 experts go through an FP4 kernel, never a dequantized copy through the bf16 one: up to
    `GEMV_SELECTIONS` (token, expert) selections the one-row-per-selection GEMV, above it the tile kernel."""
    quantized, plain = both
    cfg = quantized.config
    if strategy:
        monkeypatch.setenv("DS4JAX_MOE", strategy)
    pq, pb = quantized.params["layers"][2]["ffn"], plain.params["layers"][2]["ffn"]
    x = jax.random.normal(jax.random.key(0), tokens + (cfg.hidden_size,), jnp.float32)
    ids = jnp.arange(tokens[0] * tokens[1]).reshape(tokens)
    gemv = tokens[0] * tokens[1] * cfg.num_experts_per_tok <= routed_experts.GEMV_SELECTIONS
    routed = functools.partial(kernels.routed_experts, impl=impl)
    run = jax.jit(lambda x, p: moe.moe(x, ids, p, cfg, MlpType.TOPK, routed=routed)[0])
    expected = run(x, pb)
    calls = []
    if impl is kernels.Impl.PALLAS_INTERPRET:  # the FP4 kernel itself, not a dequantized copy through the bf16 one
        used, unused = ("grouped_gemv_fp4", "grouped_matmul_fp4")[::1 if gemv else -1]
        fp4 = getattr(pallas_kernels, used)
        for name in ("grouped_matmul", unused):
            monkeypatch.setattr(pallas_kernels, name, lambda *a, name=name, **k: pytest.fail(f"{name} called"))
        monkeypatch.setattr(pallas_kernels, used, lambda *a, **k: calls.append(1) or fp4(*a, **k))
    np.testing.assert_allclose(np.asarray(run(x, pq)), np.asarray(expected), rtol=1e-5, atol=1e-5)
    assert len(calls) == (2 if impl is kernels.Impl.PALLAS_INTERPRET else 0)  # gate + up, then down


def test_fp4_tiles_in_passes_equal_the_dequantized_experts(both, monkeypatch):
    """The reference `tiles` strategy in passes of a few tiles (`moe.TILE_PASS_BYTES`, which bounds what a Flash
    prefill gathers) indexes the FP4 bytes per pass: the dequantized experts' sum."""
    quantized, plain = both
    cfg = quantized.config
    pq, pb = (m.params["layers"][2]["ffn"] for m in (quantized, plain))
    x = jax.random.normal(jax.random.key(3), (9, cfg.hidden_size), jnp.float32)
    routing = moe.route(x, jnp.zeros((9,), jnp.int32), pb, cfg, MlpType.TOPK)
    monkeypatch.setattr(moe, "TILE_PASS_BYTES", 2 * 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4)
    got, want = (np.asarray(moe.routed_experts(x, routing, p["experts"], cfg, "tiles")) for p in (pq, pb))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch, decode", [("gfx950", "f16"), ("sm90", "f16"), ("gfx942", "f16"), (None, "f16")])
def test_fp4_gemv_takes_the_architectures_decode(both, arch, decode, monkeypatch):
    """The dispatch hands the GEMV its architecture's tiles (`gemv_block_sizes`: the word-wise float16 decode on every
    architecture), and every architecture's gives the same sum."""
    quantized, _ = both
    cfg = quantized.config
    p = quantized.params["layers"][2]["ffn"]["experts"]
    routing = moe.Routing(jnp.asarray([[1, 3], [0, 3]], jnp.int32)[:, :cfg.num_experts_per_tok],
                          jnp.full((2, cfg.num_experts_per_tok), 0.5, jnp.float32))
    x = jax.random.normal(jax.random.key(1), (2, cfg.hidden_size), jnp.float32)
    seen, gemv = [], pallas_kernels.grouped_gemv_fp4
    record = lambda *a, block_sizes, **k: seen.append(block_sizes.decode) or gemv(*a, block_sizes=block_sizes, **k)
    monkeypatch.setattr(pallas_kernels, "grouped_gemv_fp4", record)
    got = routed_experts.routed_experts_grouped(x, routing, p, cfg, interpret=True, arch=arch)
    assert seen == [decode, decode]  # gate + up, then down
    monkeypatch.setattr(pallas_kernels, "grouped_gemv_fp4", gemv)
    generic = routed_experts.routed_experts_grouped(x, routing, p, cfg, interpret=True, arch=None)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(generic))


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_quantizing_slice_by_slice_equals_the_whole_leaf(fmt):
    """`quantize_model` quantizes a stacked leaf one leading slice at a time (bounded temporaries): the same
    values and scales, the same leading axes, as the whole leaf at once."""
    from ds4jax.model.quantize import by_slice, quantize_fp4, quantize_fp8

    w = jax.random.normal(jax.random.key(3), (3, 2, 64, 48), jnp.float32) * jnp.logspace(-3, 2, 48)
    quantize = quantize_fp4 if fmt == "fp4" else functools.partial(quantize_fp8, block=(32, 16))
    whole, sliced = quantize(w), by_slice(quantize, w)
    assert sliced.shape == whole.shape == w.shape and sliced.format == whole.format
    for a, b in ((whole.values, sliced.values), (whole.scales, sliced.scales)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
