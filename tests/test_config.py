"""Config presets, validation and the HF config.json converter."""

import dataclasses

import jax
import pytest

import ds4jax
from ds4jax.model import params as P
from ds4jax.model.config import AttentionType, ConfigError, MlpType, from_hf_config


def test_presets_are_hashable_and_valid():
    for make in (ds4jax.flash, ds4jax.pro, ds4jax.tiny, lambda: ds4jax.flash_slice(4)):
        cfg = make()
        assert hash(cfg) == hash(dataclasses.replace(cfg))
        assert len(cfg.attention_types) == cfg.num_layers == len(cfg.mlp_types)


def test_flash_schedule_and_size():
    cfg = ds4jax.flash()
    assert cfg.attention_types[:2] == (AttentionType.SLIDING,) * 2
    assert len(cfg.layers_of(AttentionType.CSA)) == 21 and len(cfg.layers_of(AttentionType.HCA)) == 20
    assert cfg.mlp_types[:3] == (MlpType.HASH,) * 3 and cfg.mlp_types[3] is MlpType.TOPK
    # spec §1.1: 290.9B parameters with the MTP block, 284.3B without (eval_shape: nothing allocated)
    assert abs(P.count(P.abstract(cfg)) / 1e9 - 290.94) < 0.01
    assert abs(P.count(P.abstract(cfg.replace(num_mtp_layers=0))) / 1e9 - 284.3) < 0.1


def test_pro_schedule():
    cfg = ds4jax.pro()
    assert cfg.attention_types[:3] == (AttentionType.HCA, AttentionType.HCA, AttentionType.CSA)
    assert len(cfg.layers_of(AttentionType.HCA)) == 31 and len(cfg.layers_of(AttentionType.CSA)) == 30


def test_flash_slice_keeps_per_layer_dims():
    cfg = ds4jax.flash_slice(4)
    assert cfg.num_layers == 4 and cfg.hidden_size == 4096 and cfg.head_dim == 512
    assert cfg.attention_types == ds4jax.flash().attention_types[:4]
    with pytest.raises(ConfigError, match="num_layers"):
        ds4jax.flash_slice(0)


def test_hf_round_trip():
    for cfg in (ds4jax.tiny(), ds4jax.flash(), ds4jax.pro()):
        assert from_hf_config(cfg.to_hf_dict()) == cfg


def test_legacy_official_keys():
    d = ds4jax.flash().to_hf_dict()
    for key in ("layer_types", "mlp_layer_types", "compress_rates"):
        d.pop(key)
    d["compress_ratios"] = [0, 0] + [4, 128] * 20 + [4] + [0]  # 44 entries, trailing MTP layer
    d["num_hash_layers"] = 3
    assert from_hf_config(d) == ds4jax.flash()


@pytest.mark.parametrize("field,value", [
    ("num_heads", 0), ("o_groups", 3), ("rope_head_dim", 7), ("num_experts_per_tok", 99),
    ("attention_types", (AttentionType.SLIDING,)), ("num_shared_experts", 2), ("hc_eps", -1.0),
])
def test_invalid_config_names_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        ds4jax.tiny(**{field: value})


def test_converter_errors_name_the_field():
    d = ds4jax.tiny().to_hf_dict()
    d["num_key_value_heads"] = 8
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        from_hf_config(d)
    d = ds4jax.tiny().to_hf_dict()
    d.pop("layer_types")
    with pytest.raises(ConfigError, match="attention_types"):
        from_hf_config(d)


def test_forward_is_differentiable():
    cfg = ds4jax.tiny(num_layers=3, attention_types=(AttentionType.SLIDING, AttentionType.CSA, AttentionType.HCA),
                      mlp_types=(MlpType.HASH, MlpType.TOPK, MlpType.TOPK))
    params = jax.jit(P.init, static_argnums=0)(cfg, jax.random.key(0))  # one program, not one per leaf
    ids = jax.random.randint(jax.random.key(1), (1, 24), 0, cfg.vocab_size)

    def loss(p):
        logits = ds4jax.model.forward.forward(cfg, p, ids[:, :-1])
        return -jax.numpy.mean(jax.nn.log_softmax(logits)[0, jax.numpy.arange(23), ids[0, 1:]])

    # jitted: one forward + backward program (measured: 25 s CPU) rather than op by op (45 s, a compile per op shape)
    grads = jax.jit(jax.grad(loss, allow_int=True))(params)  # allow_int: tid2eid is an integer table
    norms = {k: float(jax.numpy.linalg.norm(g)) for k, g in
             [("wq_a", grads["layers"][1]["attn"]["wq_a"]), ("ape", grads["layers"][2]["attn"]["compressor"]["ape"]),
              ("experts", grads["layers"][1]["ffn"]["experts"]["w1"]), ("embed", grads["embed"])]}
    assert all(jax.numpy.isfinite(v) and v > 0 for v in norms.values()), norms
