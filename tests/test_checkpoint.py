"""Checkpoint loading / saving: HF round trips, naming schemes, shards, errors, FP8/FP4 dequant, MTP."""

from __future__ import annotations

import json
import math
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_reference as hr  # noqa: E402
from safetensors.torch import save_file as torch_save_file  # noqa: E402

from ds4jax.io import checkpoint  # noqa: E402
from ds4jax.io.checkpoint import CheckpointError, dequant_fp4, dequant_fp8, e8m0_to_float  # noqa: E402
from ds4jax.model.config import AttentionType, Config, MlpType, tiny  # noqa: E402
from ds4jax.model import layer_stack
from ds4jax.model.params import abstract  # noqa: E402


def variant() -> Config:
    """HCA first, 3 hash layers, hc_mult 2, 4 output groups, 6 experts top-3, no YaRN, odd vocab."""
    A = AttentionType
    return tiny(num_layers=4, attention_types=(A.HCA, A.CSA, A.SLIDING, A.HCA),
                mlp_types=(MlpType.HASH,) * 3 + (MlpType.TOPK,), hc_mult=2, o_groups=4, o_lora_rank=8,
                num_routed_experts=6, num_experts_per_tok=3, moe_intermediate_size=48, vocab_size=200, yarn=None)


CONFIGS = {"tiny": tiny, "variant": variant}


# ---- fixtures --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=sorted(CONFIGS))
def hf_ckpt(request, tmp_path_factory):
    """(cfg, HF model, save_pretrained dir, upstream state dict as numpy)."""
    cfg = CONFIGS[request.param]()
    directory = tmp_path_factory.mktemp(f"hf_{request.param}")
    model = hr.save_hf_checkpoint(cfg, directory, seed=1)
    sd = {k: v.numpy() for k, v in hr.upstream_state_dict(model, cfg).items()}
    return cfg, model, str(directory), sd


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    cfg = tiny()
    directory = tmp_path_factory.mktemp("hf_tiny_single")
    model = hr.save_hf_checkpoint(cfg, directory, seed=2)
    sd = {k: v.numpy() for k, v in hr.upstream_state_dict(model, cfg).items()}
    return cfg, model, str(directory), sd


def write_checkpoint(directory, cfg: Config, tensors: dict, shards: int = 1, index: bool = True, config: dict = None):
    """Write torch/numpy `tensors` (any names) as `shards` safetensors files (+ index) and config.json."""
    os.makedirs(directory, exist_ok=True)
    tensors = {k: torch.as_tensor(v).contiguous().clone() for k, v in tensors.items()}
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        fname = "model.safetensors" if shards == 1 else f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in names[s::shards]}
        torch_save_file(part, os.path.join(directory, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    if shards > 1 and index:
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config if config is not None else cfg.to_hf_dict(), f)
    return str(directory)


# ---- the expected params, built independently from upstream tensors (spec §5, params.py layout) ------------------

def _wo_a(w: np.ndarray, cfg: Config) -> np.ndarray:
    o = cfg.o_lora_rank
    return np.stack([w[k * o:(k + 1) * o, :].T for k in range(cfg.o_groups)])


def _compressor(sd: dict, p: str) -> dict:
    return {"wkv": sd[p + "wkv.weight"].T, "wgate": sd[p + "wgate.weight"].T, "ape": sd[p + "ape"],
            "norm": sd[p + "norm.weight"]}


def _block(sd: dict, p: str, cfg: Config, attention: AttentionType, mlp: MlpType) -> dict:
    attn = {"wq_a": sd[p + "attn.wq_a.weight"].T, "q_norm": sd[p + "attn.q_norm.weight"],
            "wq_b": sd[p + "attn.wq_b.weight"].T, "wkv": sd[p + "attn.wkv.weight"].T,
            "kv_norm": sd[p + "attn.kv_norm.weight"], "wo_a": _wo_a(sd[p + "attn.wo_a.weight"], cfg),
            "wo_b": sd[p + "attn.wo_b.weight"].T, "sink": sd[p + "attn.attn_sink"]}
    if attention is not AttentionType.SLIDING:
        attn["compressor"] = _compressor(sd, p + "attn.compressor.")
    if attention is AttentionType.CSA:
        attn["indexer"] = {"wq_b": sd[p + "attn.indexer.wq_b.weight"].T,
                           "weights_proj": sd[p + "attn.indexer.weights_proj.weight"].T,
                           "compressor": _compressor(sd, p + "attn.indexer.compressor.")}
    experts = {w: np.stack([sd[p + f"ffn.experts.{x}.{w}.weight"].T for x in range(cfg.num_routed_experts)])
               for w in ("w1", "w2", "w3")}
    ffn = {"gate": sd[p + "ffn.gate.weight"].T, "experts": experts,
           "shared": {w: sd[p + f"ffn.shared_experts.{w}.weight"].T for w in ("w1", "w2", "w3")}}
    if mlp is MlpType.HASH:
        ffn["tid2eid"] = sd[p + "ffn.gate.tid2eid"]
    else:
        ffn["bias"] = sd[p + "ffn.gate.bias"]
    hc = {name: {"fn": sd[p + f"{name}_fn"], "base": sd[p + f"{name}_base"], "scale": sd[p + f"{name}_scale"]}
          for name in ("hc_attn", "hc_ffn")}
    return {"attn_norm": sd[p + "attn_norm.weight"], "ffn_norm": sd[p + "ffn_norm.weight"], **hc,
            "attn": attn, "ffn": ffn}


def expected_params(sd: dict, cfg: Config) -> dict:
    """ds4jax params from upstream-named numpy tensors, written directly from the layout docs."""
    hc_head = lambda p: {"fn": sd[p + "hc_head_fn"], "base": sd[p + "hc_head_base"],  # noqa: E731
                         "scale": sd[p + "hc_head_scale"]}
    tree = {"embed": sd["embed.weight"], "head": sd["head.weight"].T, "norm": sd["norm.weight"],
            "hc_head": hc_head(""),
            "layers": [_block(sd, f"layers.{i}.", cfg, a, m)
                       for i, (a, m) in enumerate(zip(cfg.attention_types, cfg.mlp_types))]}
    if "mtp.0.enorm.weight" in sd:
        p = "mtp.0."
        tree["mtp"] = {"enorm": sd[p + "enorm.weight"], "hnorm": sd[p + "hnorm.weight"], "norm": sd[p + "norm.weight"],
                       "e_proj": sd[p + "e_proj.weight"].T, "h_proj": sd[p + "h_proj.weight"].T,
                       "hc_head": hc_head(p),
                       "block": _block(sd, p, cfg, AttentionType.SLIDING, MlpType.TOPK)}
    return tree


def assert_params_equal(params, expected, dtype=jnp.float32, cfg: Config | None = None):
    # a loaded Model stacks its layers for lax.scan
    params, expected = layer_stack.unstacked_params(params), layer_stack.unstacked_params(expected)
    assert jax.tree.structure(params) == jax.tree.structure(expected)
    if cfg is not None:  # dtypes and shapes exactly as declared
        want = abstract(cfg, dtype)
        if "mtp" not in params:
            want.pop("mtp", None)
        got = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
        assert got == want
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(expected)):
        b = np.asarray(b)
        if jnp.issubdtype(a.dtype, jnp.integer):
            np.testing.assert_array_equal(np.asarray(a), b, err_msg=jax.tree_util.keystr(path))
        else:
            np.testing.assert_array_equal(np.asarray(a, np.float32), b.astype(a.dtype).astype(np.float32),
                                          err_msg=jax.tree_util.keystr(path))


# ---- round trips and naming schemes --------------------------------------------------------------------------------

def test_save_pretrained_names(hf_ckpt):
    """Pin what transformers 5.24 save_pretrained writes (documented in ds4jax.checkpoint)."""
    from safetensors import safe_open

    _, _, directory, _ = hf_ckpt
    with safe_open(os.path.join(directory, "model.safetensors"), "np") as f:
        keys = set(f.keys())
    assert {"head.weight", "model.embed_tokens.weight", "model.norm.weight", "model.hc_head.hc_fn",
            "model.layers.0.attn.norm.weight", "model.layers.0.hc_attn_fn", "model.layers.0.ffn.experts.0.w1.weight",
            "model.layers.1.attn.indexer.compressor.ape"} <= keys


def test_hf_save_pretrained_roundtrip(hf_ckpt):
    cfg, _, directory, sd = hf_ckpt
    model = checkpoint.load(directory, dtype=jnp.float32)
    assert model.config == cfg
    assert not model.has_mtp
    assert_params_equal(model.params, expected_params(sd, cfg), jnp.float32, cfg)


def test_bf16_load(hf_ckpt):
    cfg, _, directory, sd = hf_ckpt
    model = checkpoint.load(directory)  # default bf16; fp32 leaves stay fp32, tid2eid int32
    assert model.params["layers"][0]["attn"]["wq_a"].dtype == jnp.bfloat16
    assert model.params["layers"][0]["attn_norm"].dtype == jnp.float32
    assert model.params["layers"][0]["ffn"]["tid2eid"].dtype == jnp.int32
    assert_params_equal(model.params, expected_params(sd, cfg), jnp.bfloat16, cfg)


def test_upstream_names(hf_ckpt, tmp_path):
    cfg, _, _, sd = hf_ckpt
    directory = write_checkpoint(tmp_path, cfg, sd)
    assert_params_equal(checkpoint.load(directory, jnp.float32).params, expected_params(sd, cfg), cfg=cfg)


def test_hf_in_memory_names(hf_ckpt, tmp_path):
    """model.state_dict() names: self_attn.*, mlp.experts.gate_up_proj [x, 2f, e] / down_proj, lm_head."""
    cfg, model, _, sd = hf_ckpt
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state and "lm_head.weight" in state
    directory = write_checkpoint(tmp_path, cfg, state)
    assert_params_equal(checkpoint.load(directory, jnp.float32).params, expected_params(sd, cfg), cfg=cfg)


def test_sharded_with_and_without_index(tiny_ckpt, tmp_path):
    cfg, _, _, sd = tiny_ckpt
    expected = expected_params(sd, cfg)
    with_index = write_checkpoint(tmp_path / "idx", cfg, sd, shards=3)
    assert os.path.exists(os.path.join(with_index, "model.safetensors.index.json"))
    assert_params_equal(checkpoint.load(with_index, jnp.float32).params, expected)
    no_index = write_checkpoint(tmp_path / "noidx", cfg, sd, shards=3, index=False)
    assert_params_equal(checkpoint.load(no_index, jnp.float32).params, expected)


def test_index_is_authoritative(tiny_ckpt, tmp_path):
    """With an index, stray *.safetensors files not listed in it are ignored."""
    cfg, _, _, sd = tiny_ckpt
    directory = write_checkpoint(tmp_path, cfg, sd, shards=2)
    torch_save_file({"junk": torch.zeros(2)}, os.path.join(directory, "stray.safetensors"))
    assert_params_equal(checkpoint.load(directory, jnp.float32).params, expected_params(sd, cfg))


# ---- errors --------------------------------------------------------------------------------------------------------

def _load_error(directory) -> str:
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(directory, jnp.float32)
    return str(info.value)


def test_missing_shard(tiny_ckpt, tmp_path):
    cfg, _, _, sd = tiny_ckpt
    directory = write_checkpoint(tmp_path, cfg, sd, shards=3)
    os.remove(os.path.join(directory, "model-00002-of-00003.safetensors"))
    assert "missing shard model-00002-of-00003.safetensors" in _load_error(directory)


def test_missing_tensor(tiny_ckpt, tmp_path):
    cfg, _, _, sd = tiny_ckpt
    sd = dict(sd)
    del sd["layers.2.attn.wq_a.weight"]
    msg = _load_error(write_checkpoint(tmp_path, cfg, sd))
    assert "missing tensor layers.2.attn.wq_a.weight" in msg and "model.layers.2.self_attn.q_a_proj.weight" in msg


def test_missing_expert(tiny_ckpt, tmp_path):
    cfg, _, _, sd = tiny_ckpt
    sd = {k: v for k, v in sd.items() if k != "layers.2.ffn.experts.5.w2.weight"}
    assert "missing tensor layers.2.ffn.experts.5.w2.weight" in _load_error(write_checkpoint(tmp_path, cfg, sd))


def test_unexpected_tensor(tiny_ckpt, tmp_path):
    cfg, _, _, sd = tiny_ckpt
    sd = {**sd, "layers.0.attn.bogus.weight": np.zeros((2, 2), np.float32)}
    msg = _load_error(write_checkpoint(tmp_path, cfg, sd))
    assert "unexpected tensor layers.0.attn.bogus.weight in model.safetensors" in msg


def test_layer_beyond_config_is_unexpected(tiny_ckpt, tmp_path):
    cfg, _, _, sd = tiny_ckpt
    sd = {**sd, "layers.3.attn_norm.weight": np.ones(cfg.hidden_size, np.float32)}
    assert "unexpected tensor layers.3.attn_norm.weight" in _load_error(write_checkpoint(tmp_path, cfg, sd))


def test_duplicate_tensor(tiny_ckpt, tmp_path):
    cfg, _, _, sd = tiny_ckpt
    sd = {**sd, "model.embed_tokens.weight": sd["embed.weight"]}
    msg = _load_error(write_checkpoint(tmp_path, cfg, sd))
    assert "embed.weight is given twice" in msg and "model.embed_tokens.weight" in msg


def test_wrong_shape(tiny_ckpt, tmp_path):
    cfg, _, _, sd = tiny_ckpt
    sd = {**sd, "layers.1.attn.wq_a.weight": sd["layers.1.attn.wq_a.weight"].T}  # [e, l] instead of [l, e]
    msg = _load_error(write_checkpoint(tmp_path, cfg, sd))
    assert "tensor layers.1.attn.wq_a.weight in model.safetensors: wrong shape" in msg
    assert f"expected [{cfg.q_lora_rank}, {cfg.hidden_size}] got [{cfg.hidden_size}, {cfg.q_lora_rank}]" in msg


@pytest.mark.parametrize("name, value, needs", [
    ("layers.0.ffn.gate.tid2eid", lambda a: a.astype(np.float32), "integer"),
    ("layers.2.attn.wkv.weight", lambda a: a.astype(np.int64), "floating-point"),
    ("layers.2.attn_norm.weight", lambda a: a.astype(np.int32), "floating-point"),
])
def test_wrong_dtype(tiny_ckpt, tmp_path, name, value, needs):
    cfg, _, _, sd = tiny_ckpt
    msg = _load_error(write_checkpoint(tmp_path, cfg, {**sd, name: value(sd[name])}))
    assert f"tensor {name} in model.safetensors: wrong dtype" in msg and needs in msg


def test_tid2eid_out_of_range(tiny_ckpt, tmp_path):
    cfg, _, _, sd = tiny_ckpt
    bad = sd["layers.1.ffn.gate.tid2eid"].copy()
    bad[7, 1] = cfg.num_routed_experts
    msg = _load_error(write_checkpoint(tmp_path, cfg, {**sd, "layers.1.ffn.gate.tid2eid": bad}))
    assert "layers.1.ffn.gate.tid2eid" in msg and f"[0, {cfg.num_routed_experts})" in msg


def test_bad_config(tiny_ckpt, tmp_path):
    cfg, _, _, sd = tiny_ckpt
    directory = write_checkpoint(tmp_path / "bad", cfg, sd, config={**cfg.to_hf_dict(), "o_groups": 3})
    msg = _load_error(directory)
    assert "bad config" in msg and "config.json" in msg and "o_groups" in msg
    os.remove(os.path.join(directory, "config.json"))
    assert "config.json does not exist" in _load_error(directory)


def test_no_safetensors(tmp_path):
    with open(tmp_path / "config.json", "w") as f:
        json.dump(tiny().to_hf_dict(), f)
    assert "no *.safetensors" in _load_error(tmp_path)


# ---- quantization ----------------------------------------------------------------------------------------------

def test_e8m0_values():
    raw = np.array([127, 128, 126, 0, 254, 255], np.uint8)
    got = e8m0_to_float(raw)
    np.testing.assert_array_equal(got[:5], [1.0, 2.0, 0.5, 2.0**-127, 2.0**127])
    assert np.isnan(got[5])


def test_fp8_hand_values():
    # e4m3fn bytes: 0x38 = 1.0, 0x40 = 2.0, 0xB8 = -1.0, 0x7E = 448, 0x01 = 2^-9 (smallest subnormal), 0x3C = 1.5
    raw = np.array([[0x38, 0x40, 0xB8], [0x7E, 0x01, 0x3C]], np.uint8)
    scale = np.array([[4.0, 0.5]], np.float32)  # block (2, 2): columns 0-1 x4, column 2 x0.5
    want = np.array([[4.0, 8.0, -0.5], [1792.0, 2.0**-7, 0.75]], np.float32)
    np.testing.assert_array_equal(dequant_fp8(raw, scale, block=(2, 2)), want)


def test_fp4_hand_values():
    # byte 0x21: low nibble 1 (0.5) is element 0, high nibble 2 (1.0) element 1; 0xF7: 6.0 then -6.0; 0x98: -0, -0.5
    packed = np.array([[0x21, 0xF7] * 16 + [0x98, 0x00] * 16], np.uint8).view(np.int8)  # [1, 64] -> 128 values
    scale = np.array([[2.0, 0.25, 1.0, 8.0]], np.float32)
    got = dequant_fp4(packed, scale)
    assert got.shape == (1, 128)
    np.testing.assert_array_equal(got[0, :4], [1.0, 2.0, 12.0, -12.0])
    np.testing.assert_array_equal(got[0, 32:36], [0.125, 0.25, 1.5, -1.5])
    np.testing.assert_array_equal(got[0, 64:68], [-0.0, -0.5, 0.0, 0.0])
    np.testing.assert_array_equal(got[0, 96:100], [-0.0, -4.0, 0.0, 0.0])


# Test-side encoders (independent of the loader): power-of-two block scales chosen so the block max fits the format.

def quantize_fp8(w: np.ndarray, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """-> (E4M3 weight, E8M0 scale [ceil(r/br), ceil(c/bc)], exact dequantized value)."""
    r, c = w.shape
    grid = (math.ceil(r / block[0]), math.ceil(c / block[1]))
    exps = np.zeros(grid, np.int32)
    for i in range(grid[0]):
        for j in range(grid[1]):
            amax = np.abs(w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]).max()
            exps[i, j] = math.ceil(math.log2(amax / 448.0)) if amax > 0 else 0
    full = np.repeat(np.repeat(exps, block[0], 0), block[1], 1)[:r, :c]
    q = torch.from_numpy(np.ldexp(w, -full).astype(np.float32)).to(torch.float8_e4m3fn)
    scale = torch.from_numpy((exps + 127).astype(np.uint8)).view(torch.float8_e8m0fnu)
    return q, scale, np.ldexp(q.float().numpy(), full)


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def quantize_fp4(w: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """-> (I8 packed [r, c/2] low nibble first, E8M0 scale [r, c/32], exact dequantized value)."""
    r, c = w.shape
    blocks = w.reshape(r, c // 32, 32)
    amax = np.abs(blocks).max(-1)
    exps = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), 0).astype(np.int32)
    scaled = np.ldexp(blocks, -exps[..., None]).reshape(r, c)
    idx = np.abs(scaled[..., None] - E2M1).argmin(-1).astype(np.uint8)  # nearest e2m1 value
    packed = (idx[:, 0::2] | (idx[:, 1::2] << 4)).astype(np.uint8)
    scale = torch.from_numpy((exps + 127).astype(np.uint8)).view(torch.float8_e8m0fnu)
    exact = np.ldexp(E2M1[idx].reshape(r, c // 32, 32), exps[..., None]).reshape(r, c)
    return torch.from_numpy(packed.view(np.int8)), scale, exact


def test_fp8_roundtrip_ragged_blocks():
    w = np.random.default_rng(0).standard_normal((300, 200)).astype(np.float32) * 3
    w[:128, :128] *= 1e-3  # blocks at very different scales
    q, s, exact = quantize_fp8(w)
    assert tuple(s.shape) == (3, 2)
    got = dequant_fp8(q.view(torch.uint8).numpy(), e8m0_to_float(s.view(torch.uint8).numpy()))
    np.testing.assert_array_equal(got, exact)
    np.testing.assert_allclose(got, w, rtol=2**-3, atol=1e-6)  # e4m3 has 3 mantissa bits


def test_fp4_roundtrip():
    w = np.random.default_rng(1).standard_normal((48, 96)).astype(np.float32)
    packed, s, exact = quantize_fp4(w)
    got = dequant_fp4(packed.numpy(), e8m0_to_float(s.view(torch.uint8).numpy()))
    np.testing.assert_array_equal(got, exact)
    assert np.abs(got - w).max() <= np.abs(w).max() / 3  # e2m1 is coarse, but it must be the same matrix


FP8_LINEARS = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b",
               "ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3", "e_proj", "h_proj")


def quantize_checkpoint(sd: dict, scale_suffix: str = ".scale", block=(128, 128)) -> tuple[dict, dict]:
    """Official mixed format: FP8 linears (spec list), FP4 routed experts. -> (tensors to write, exact fp32 values)."""
    out, exact = {}, {}
    for name, value in sd.items():
        base = name[: -len(".weight")]
        if name.endswith(".weight") and base.endswith(FP8_LINEARS) and ".ffn.experts." not in name:
            q, s, exact[name] = quantize_fp8(value, block)
        elif ".ffn.experts." in name:
            q, s, exact[name] = quantize_fp4(value)
        else:
            out[name], exact[name] = value, value
            continue
        out[name] = q
        out[base + (".weight_scale_inv" if scale_suffix == ".weight_scale_inv" else ".scale")] = s
    return out, exact


@pytest.mark.parametrize("scale_suffix, block", [(".scale", (128, 128)), (".weight_scale_inv", (16, 16))])
def test_quantized_checkpoint(tiny_ckpt, tmp_path, scale_suffix, block):
    cfg, _, _, sd = tiny_ckpt
    tensors, exact = quantize_checkpoint(sd, scale_suffix, block)
    config = cfg.to_hf_dict()
    if block != (128, 128):  # exercise many blocks per matrix in a tiny model
        config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(block), "fmt": "e4m3"}
    directory = write_checkpoint(tmp_path, cfg, tensors, config=config)
    assert_params_equal(checkpoint.load(directory, jnp.float32).params, expected_params(exact, cfg), cfg=cfg)


def test_quantized_fused_hf_experts(tiny_ckpt, tmp_path):
    """HF in-memory names with FP8 fused experts: gate_up_proj + gate_up_proj_scale_inv [x, 2f/16, e/16]."""
    cfg, model, _, sd = tiny_ckpt
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    exact = dict(sd)
    f = cfg.moe_intermediate_size
    for i in range(cfg.num_layers):
        for fused in ("gate_up_proj", "down_proj"):
            key = f"model.layers.{i}.mlp.experts.{fused}"
            per_expert = [quantize_fp8(w, (16, 16)) for w in state[key].numpy()]
            state[key] = torch.stack([q for q, _, _ in per_expert])
            state[key + "_scale_inv"] = torch.stack([s for _, s, _ in per_expert])
            for x, (_, _, value) in enumerate(per_expert):
                p = f"layers.{i}.ffn.experts.{x}."
                if fused == "gate_up_proj":
                    exact[p + "w1.weight"], exact[p + "w3.weight"] = value[:f], value[f:]
                else:
                    exact[p + "w2.weight"] = value
    config = {**cfg.to_hf_dict(), "quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}}
    directory = write_checkpoint(tmp_path, cfg, state, config=config)
    assert_params_equal(checkpoint.load(directory, jnp.float32).params, expected_params(exact, cfg), cfg=cfg)


def test_quantized_errors(tiny_ckpt, tmp_path):
    cfg, _, _, sd = tiny_ckpt
    tensors, _ = quantize_checkpoint(sd)
    no_scale = {k: v for k, v in tensors.items() if k != "layers.0.attn.wq_a.scale"}
    msg = _load_error(write_checkpoint(tmp_path / "a", cfg, no_scale))
    assert "layers.0.attn.wq_a.weight" in msg and "without its scale" in msg
    bad_scale = {**tensors, "layers.0.ffn.experts.2.w1.scale": torch.zeros((3, 3), dtype=torch.uint8)}
    msg = _load_error(write_checkpoint(tmp_path / "b", cfg, bad_scale))
    assert "layers.0.ffn.experts.2.w1.scale" in msg and "wrong shape" in msg
    orphan = {**sd, "layers.0.attn.wkv.scale": tensors["layers.0.attn.wkv.scale"]}
    msg = _load_error(write_checkpoint(tmp_path / "c", cfg, orphan))
    assert "unexpected tensor layers.0.attn.wkv.scale" in msg


# ---- MTP -----------------------------------------------------------------------------------------------------------

def test_mtp_load(tiny_ckpt, tmp_path):
    cfg, _, source, sd = tiny_ckpt
    directory = shutil.copytree(source, tmp_path / "ckpt")
    mtp = hr.add_random_mtp(directory, cfg, seed=3)
    model = checkpoint.load(directory, jnp.float32)
    assert model.has_mtp
    assert_params_equal(model.params, expected_params({**sd, **mtp}, cfg), cfg=cfg)


def test_mtp_sharded_index(tiny_ckpt, tmp_path):
    cfg, _, _, sd = tiny_ckpt
    directory = write_checkpoint(tmp_path, cfg, sd, shards=2)
    mtp = hr.add_random_mtp(directory, cfg, seed=4)  # also registers mtp.safetensors in the index
    assert_params_equal(checkpoint.load(directory, jnp.float32).params, expected_params({**sd, **mtp}, cfg))


def test_partial_mtp(tiny_ckpt, tmp_path):
    cfg, _, source, _ = tiny_ckpt
    directory = shutil.copytree(source, tmp_path / "ckpt")
    mtp = hr.add_random_mtp(directory, cfg)
    del mtp["mtp.0.attn.wkv.weight"]
    torch_save_file({k: torch.from_numpy(v) for k, v in mtp.items()}, os.path.join(directory, "mtp.safetensors"))
    msg = _load_error(directory)
    assert "partial MTP" in msg and "mtp.0.attn.wkv.weight" in msg


def test_mtp_without_mtp_config_is_unexpected(tiny_ckpt, tmp_path):
    cfg, _, source, _ = tiny_ckpt
    directory = shutil.copytree(source, tmp_path / "ckpt")
    hr.add_random_mtp(directory, cfg)
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**config, "num_nextn_predict_layers": 0}, f)
    assert "unexpected tensor mtp.0." in _load_error(directory)


# ---- save ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_save_load_roundtrip(tiny_ckpt, tmp_path, dtype):
    cfg, _, source, _ = tiny_ckpt
    directory = shutil.copytree(source, tmp_path / "src")
    hr.add_random_mtp(directory, cfg)
    model = checkpoint.load(directory, dtype)
    out = tmp_path / "saved"
    checkpoint.save(model, out, max_shard_bytes=300_000)
    files = sorted(os.listdir(out))
    assert "config.json" in files and "model.safetensors.index.json" in files
    assert sum(f.endswith(".safetensors") for f in files) > 2
    with open(out / "model.safetensors.index.json") as f:
        names = json.load(f)["weight_map"]
    assert "embed.weight" in names and "mtp.0.e_proj.weight" in names and "layers.0.ffn.experts.7.w2.weight" in names
    again = checkpoint.load(out, dtype)
    assert again.config == model.config and again.has_mtp
    assert_params_equal(again.params, model.params, dtype, cfg)
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        checkpoint.save(model, out)
    checkpoint.save(model, out, overwrite=True)  # one shard, no index left behind
    assert not os.path.exists(out / "model.safetensors.index.json")
    assert_params_equal(checkpoint.load(out, dtype).params, model.params, dtype, cfg)


def test_saved_checkpoint_matches_upstream_format(tiny_ckpt, tmp_path):
    """`save` writes exactly the upstream names and [out, in] orientation."""
    from safetensors.numpy import load_file

    cfg, _, source, sd = tiny_ckpt
    checkpoint.save(checkpoint.load(source, jnp.float32), tmp_path)
    written = load_file(str(tmp_path / "model.safetensors"))
    assert set(written) == set(sd)
    for name, value in sd.items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)
    assert written["layers.0.ffn.gate.tid2eid"].dtype == np.int64
