"""The published checkpoint layout end to end (issue 26 item 4) and the quantization formats against ml_dtypes.

The fixture is a random tiny DeepSeek-V4 written as the published instruct checkpoint (`write_official_random`):
upstream names without ``model.``, FP8 E4M3 + E8M0 128x128 block scales for the dense linears, I8-packed FP4 experts
with one E8M0 scale per 32 inputs, ``compress_ratios`` with the MTP entry, three shards and an index.
"""

import glob
import json
import os
import subprocess
import sys
from contextlib import ExitStack

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

import ds4jax
from ds4jax.io import convert, official_format, quant_formats as qf
from ds4jax.io.official_random import write_official_random
from ds4jax.io.safetensors_layout import EXPERTS, INDEX_FILE, T, WO_A, Shard, path_of, plan

HERE = os.path.dirname(os.path.abspath(__file__))


# ---- formats against ml_dtypes -----------------------------------------------------------------------------------

def test_e8m0_matches_ml_dtypes():
    b = np.arange(255, dtype=np.uint8)  # 255 is NaN in both
    np.testing.assert_array_equal(qf.e8m0_to_float(b), b.view(ml_dtypes.float8_e8m0fnu).astype(np.float32))
    assert np.isnan(qf.e8m0_to_float(np.array([255], np.uint8))).all()


def test_fp8_round_trip_against_ml_dtypes():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((300, 200)).astype(np.float32) * 3
    w[:128, :128] *= 1e-3  # blocks at very different scales
    w[128:256, 128:] = 0  # an all-zero block
    q, s = qf.quantize_fp8(w, (128, 128))
    assert q.shape == w.shape and s.shape == (3, 2) and q.dtype == s.dtype == np.uint8
    scale = np.repeat(np.repeat(s.view(ml_dtypes.float8_e8m0fnu).astype(np.float32), 128, 0), 128, 1)[:300, :200]
    expected = q.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale
    got = qf.dequant_fp8(q, qf.e8m0_to_float(s), (128, 128))
    np.testing.assert_array_equal(got, expected)
    # each value is w rounded to nearest e4m3 at its block's scale: exactly ml_dtypes' cast of w / scale
    np.testing.assert_array_equal(q.view(ml_dtypes.float8_e4m3fn), (w / scale).astype(ml_dtypes.float8_e4m3fn))
    assert np.abs(w / scale).max() <= qf.FP8_MAX
    # half an ulp: 2^-4 relative with 3 mantissa bits, 2^-10 of the scale among the subnormals
    assert (np.abs(got - w) <= np.maximum(np.abs(w) * 2**-4, scale * 2**-10)).all()


def test_fp4_round_trip_against_ml_dtypes():
    w = np.random.default_rng(1).standard_normal((48, 96)).astype(np.float32)
    w[0, :32] = 0
    packed, s = qf.quantize_fp4(w)
    assert packed.shape == (48, 48) and s.shape == (48, 3)
    codes = np.stack([packed & 0xF, packed >> 4], -1).reshape(48, 96)  # low nibble = even element
    values = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    scale = np.repeat(s.view(ml_dtypes.float8_e8m0fnu).astype(np.float32), 32, 1)
    np.testing.assert_array_equal(qf.dequant_fp4(packed, qf.e8m0_to_float(s)), values * scale)
    np.testing.assert_array_equal(values, (w / scale).astype(ml_dtypes.float4_e2m1fn).astype(np.float32))
    assert np.abs(w / scale).max() <= qf.FP4_MAX


# ---- the official layout -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def official(tmp_path_factory):
    directory = tmp_path_factory.mktemp("official")
    source = write_official_random(directory, seed=5)
    return source, str(directory)


def _headers(directory):
    out = {}
    for f in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        with safe_open(f, "np") as h:
            out.update({k: (h.get_slice(k).get_dtype(), tuple(h.get_slice(k).get_shape()), os.path.basename(f))
                        for k in h.keys()})
    return out


def test_written_in_the_published_layout(official):
    source, directory = official
    cfg = source.config
    headers = _headers(directory)
    assert not any(k.startswith("model.") for k in headers)
    assert {"embed.weight", "head.weight", "hc_head_fn", "mtp.0.e_proj.weight", "mtp.0.hc_head_base"} <= set(headers)
    e, f = cfg.hidden_size, cfg.moe_intermediate_size
    assert headers["layers.1.ffn.experts.7.w1.weight"][:2] == ("I8", (f, e // 2))
    assert headers["layers.1.ffn.experts.7.w1.scale"][:2] == ("F8_E8M0", (f, e // 32))
    assert headers["layers.1.ffn.experts.7.w2.weight"][:2] == ("I8", (e, f // 2))
    assert headers["layers.0.attn.wq_b.weight"][:2] == ("F8_E4M3", (cfg.num_heads * cfg.head_dim, cfg.q_lora_rank))
    assert headers["layers.0.attn.wq_b.scale"][:2] == ("F8_E8M0", (1, 1))
    assert headers["layers.1.attn.compressor.wkv.weight"][0] == "BF16"
    assert headers["layers.0.hc_attn_fn"][0] == headers["layers.0.attn.attn_sink"][0] == "F32"
    assert headers["layers.0.ffn.gate.tid2eid"][0] == "I64"
    with open(os.path.join(directory, INDEX_FILE)) as fh:
        weight_map = json.load(fh)["weight_map"]
    assert {k: v[2] for k, v in headers.items()} == weight_map and len(set(weight_map.values())) >= 3
    with open(os.path.join(directory, "config.json")) as fh:
        config = json.load(fh)
    assert len(config["compress_ratios"]) == cfg.num_layers + 1 and "layer_types" not in config
    assert config["quantization_config"]["weight_block_size"] == [128, 128] and config["expert_dtype"] == "fp4"


def dequantized_expected(source, directory):
    """The fp32 params the checkpoint holds, computed apart from the loader: every weight read and dequantized
    with `quant_formats`, laid out like `ds4jax.model.params` by the plan's layouts."""
    headers = _headers(directory)
    raw = {}
    with ExitStack() as stack:
        shards = {f: Shard(os.path.join(directory, f), stack) for f in {v[2] for v in headers.values()}}
        read = lambda name: shards[headers[name][2]].read(name)
        for name, (dtype, _, _) in headers.items():
            if name.endswith(".scale"):
                continue
            w, scale = read(name), name[: -len(".weight")] + ".scale"
            if scale in headers:
                s = qf.e8m0_to_float(read(scale))
                w = qf.dequant_fp8(w, s) if dtype == "F8_E4M3" else qf.dequant_fp4(w, s)
            raw[name] = w if np.issubdtype(w.dtype, np.integer) else np.asarray(w, np.float32)
    out = {}
    for leaf in plan(source.config, jnp.float32):
        if leaf.layout == EXPERTS:
            out[leaf.path] = np.stack([raw[n].T for n in leaf.sources])
        else:
            a = raw[leaf.sources[0]]
            if leaf.layout == T:
                a = a.T
            elif leaf.layout == WO_A:  # [g*o, h*d/g] rows group-major -> [g, h*d/g, o]
                g, _, o = leaf.target.shape
                a = np.stack([a[k * o:(k + 1) * o].T for k in range(g)])
            out[leaf.path] = a
    return out


def test_loads_as_the_dequantized_fp32_values(official):
    source, directory = official
    model = ds4jax.load(directory, jnp.float32)
    expected = dequantized_expected(source, directory)
    got = jax.tree_util.tree_flatten_with_path(model.unrolled().params)[0]
    assert {path_of(kp) for kp, _ in got} == set(expected)
    for kp, a in got:
        np.testing.assert_array_equal(np.asarray(a), expected[path_of(kp)].astype(np.asarray(a).dtype),
                                      err_msg=jax.tree_util.keystr(kp))
    # the quantized model is the random one it came from, to FP8/FP4 precision
    ref = ds4jax.forward_logits(source, np.arange(16)[None] % source.config.vocab_size)
    out = ds4jax.forward_logits(model, np.arange(16)[None] % source.config.vocab_size)
    assert np.abs(np.asarray(out) - np.asarray(ref)).max() < 0.25 * np.abs(np.asarray(ref)).max()


def test_loads_sharded_onto_8_devices(official):
    _, directory = official
    proc = subprocess.run([sys.executable, os.path.join(HERE, "official_mesh_worker.py"), directory],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_orbax_and_back_and_quantize_again(official, tmp_path):
    _, directory = official
    model = ds4jax.load(directory, jnp.float32)
    assert convert.convert(directory, tmp_path / "orbax", dtype=jnp.float32) == "orbax"
    via_orbax = ds4jax.load(tmp_path / "orbax", jnp.float32)
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(via_orbax.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # `ds4jax convert --quantize fp4`: Orbax -> the published layout again, same values (they are on the grids)
    assert convert.convert(tmp_path / "orbax", tmp_path / "again", quantize="fp4") == "safetensors"
    assert set(_headers(tmp_path / "again")) == set(_headers(directory))
    again = ds4jax.load(tmp_path / "again", jnp.float32)
    for (kp, a), b in zip(jax.tree_util.tree_flatten_with_path(model.params)[0], jax.tree.leaves(again.params)):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(b, a, rtol=2**-7, atol=1e-30, err_msg=jax.tree_util.keystr(kp))  # bf16 leaves


def test_convert_quantize_rejects_orbax_target(official, tmp_path):
    _, directory = official
    with pytest.raises(ds4jax.errors.ArgumentError, match="quantize"):
        convert.convert(directory, tmp_path / "x", to="orbax", quantize="fp8")
    assert not os.path.exists(tmp_path / "x")


def test_save_rejects_unknown_format(official, tmp_path):
    source, _ = official
    with pytest.raises(ds4jax.errors.ArgumentError, match="quantize"):
        ds4jax.save(source, tmp_path / "x", quantize="int4")
    assert official_format.weight_format("layers.0.attn.wq_a.weight", "fp8") == "fp8"


def test_convert_quantize_via_cli(official, tmp_path, capsys):
    from ds4jax.cli import main

    _, directory = official
    assert main(["convert", directory, str(tmp_path / "base"), "--quantize", "fp8"]) == 0
    headers = _headers(tmp_path / "base")
    assert headers["layers.1.ffn.experts.0.w1.weight"][0] == "F8_E4M3"  # base layout: FP8 experts
    assert headers["layers.1.ffn.experts.0.w1.scale"][1] == (1, 1)  # 128x128 blocks over [f, e]
    assert main(["convert", directory, str(tmp_path / "o"), "--to", "orbax", "--quantize", "fp4"]) == 2
    assert "quantize" in capsys.readouterr().err and not os.path.exists(tmp_path / "o")


def test_default_model_quantizes(tmp_path):
    """`ds4jax convert checkpoints/default DST --quantize fp4`: the shipped model in the published layout."""
    from ds4jax.io.default_model import default_checkpoint, default_model

    assert convert.convert(default_checkpoint(), tmp_path / "q", quantize="fp4") == "safetensors"
    quantized, model = ds4jax.load(tmp_path / "q", jnp.float32, weights="checkpoint"), default_model(jnp.float32)
    assert quantized.params["layers"][0]["ffn"]["experts"]["w1"].format.value == "fp4"
    ids = np.arange(32)[None] % model.config.vocab_size
    a, b = (np.asarray(ds4jax.forward_logits(m, ids), np.float64).ravel() for m in (quantized, model))
    assert a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) > 0.99  # measured 0.9976 over 64 positions




@pytest.mark.parametrize("weights", ["bf16", "checkpoint"])
def test_loading_lifts_no_array_through_a_program(official, weights):
    """Each leaf goes to the device as a transfer when it is read: `jnp.asarray` of a numpy array compiles an
    identity program (`jit(stage)`) per shape in jax 0.10+, dozens of compiles before a first token. (Stacking a
    scanned model's layers still compiles one small `jit(stack)` per leaf shape.)"""
    from ds4jax.generation import compiles

    _, directory = official
    jax.clear_caches()  # programs this process compiled earlier count again (a cache hit is counted as a compile)
    before = compiles.program_compiles()
    model = ds4jax.load(directory, jnp.float32, weights=weights)
    compiled = compiles.program_compiles() - before
    assert set(compiled) <= {"jit(stack)"}, compiled
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(model.params))  # on the device


# ---- values that cannot load: every load path refuses them, naming the tensor -------------------------------------

def _poisoned(directory: str, tmp_path, *, dtype: str, name_part: str, byte_at: int, byte: int) -> str:
    """A copy of the checkpoint in `directory` with one byte of the first `dtype` tensor whose name contains
    `name_part` set to `byte` (`byte_at` bytes into its data)."""
    import shutil
    import struct

    out = tmp_path / "poisoned"
    shutil.copytree(directory, out)
    for path in sorted(glob.glob(os.path.join(out, "*.safetensors"))):
        raw = open(path, "rb").read()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        names = [k for k, v in header.items() if k != "__metadata__" and v["dtype"] == dtype and name_part in k]
        if names:
            body = bytearray(raw[8 + n :])
            body[header[names[0]]["data_offsets"][0] + byte_at] = byte
            open(path, "wb").write(raw[: 8 + n] + bytes(body))
            return str(out)
    raise AssertionError(f"no {dtype} tensor named *{name_part}*")


LOAD_PATHS = {  # each way `ds4jax.load` reads quantized tensors
    "dequantized": dict(weights="bf16"),
    "kept quantized": dict(weights="checkpoint"),
    "sharded": dict(mesh="tensor=2"),
}


def _load(directory, dtype=jnp.float32, mesh=None, **kwargs):
    if mesh is not None:
        kwargs["mesh"] = ds4jax.make_mesh(**{k: int(v) for k, v in [mesh.split("=")]})
    return ds4jax.load(directory, dtype, **kwargs)


@pytest.mark.parametrize("path", LOAD_PATHS)
@pytest.mark.parametrize("byte, says", [(0xFF, r"non-finite scale nan"),
                                         (0xFE, r"scale 1\.701e\+38 at index \[0, 0\] overflows float32")])
def test_a_scale_that_cannot_dequantize_is_refused_on_every_path(official, tmp_path, path, byte, says):
    """E8M0 byte 255 is NaN; 254 is 2^127, finite, but 448 x 2^127 is no float32: either loaded as a block of NaN
    or Inf weights (the sharded loader took both, the others the second) before the scales were checked on
    every path."""
    poisoned = _poisoned(official[1], tmp_path, dtype="F8_E8M0", name_part=".attn.wq_b.scale", byte_at=0, byte=byte)
    with pytest.raises(ds4jax.errors.CheckpointError, match=rf"layers\.0\.attn\.wq_b\.scale: {says}"):
        _load(poisoned, **LOAD_PATHS[path])


def test_an_fp4_scale_too_large_for_float16_is_refused(official, tmp_path):
    """The limit is the dtype the values load into: 6 x 2^14 fits float32 and not float16 (max 65504)."""
    poisoned = _poisoned(official[1], tmp_path, dtype="F8_E8M0", name_part="ffn.experts.", byte_at=0,
                         byte=127 + 14)
    _load(poisoned, weights="bf16")  # float32: fits
    says = r"scale 1\.638e\+04 at index \[0, 0\] overflows float16: its block's I8 values reach 6 x"
    with pytest.raises(ds4jax.errors.CheckpointError, match=says):
        _load(poisoned, jnp.float16, weights="bf16")


@pytest.mark.parametrize("mesh", [None, "tensor=2"])
def test_check_finite_checks_values_as_they_load(official, tmp_path, mesh):
    """A bfloat16 of ~1.7e38 is finite, and Inf as float16: `check_finite` now checks what is loaded (it checked
    the file's values, and the sharded loader checked nothing)."""
    poisoned = _poisoned(official[1], tmp_path, dtype="BF16", name_part="embed", byte_at=1, byte=0x7F)  # 0x7F00..
    model = _load(poisoned, jnp.float16, mesh=mesh)  # without the check: loaded as it is, Inf included
    assert not np.isfinite(np.asarray(model.params["embed"], np.float32)).all()
    says = r"embed\.weight: non-finite value inf at index \[0, 0\] \(as float16\)"
    with pytest.raises(ds4jax.errors.CheckpointError, match=says):
        _load(poisoned, jnp.float16, mesh=mesh, check_finite=True)


def test_weights_kept_quantized_are_sized_before_they_load(official, monkeypatch):
    """`weights="checkpoint"` checks the device's free memory against the weights as they will be kept (each
    leaf's format from the files) before reading a tensor, as the dequantizing load checks its own size: a
    checkpoint too large failed partway through, in an allocation. The estimate is what loads, to the byte."""
    from ds4jax.runtime import memory

    _, directory = official
    seen = []
    real = memory.check_fits
    monkeypatch.setattr(memory, "check_fits", lambda nbytes, what, device=None: seen.append((nbytes, what)))
    model = ds4jax.load(directory, jnp.float32, weights="checkpoint")
    (nbytes, what), = seen
    assert nbytes == sum(leaf.nbytes for leaf in jax.tree.leaves(model.params)), (nbytes, what)
    assert "tensors kept FP8 / FP4" in what
    monkeypatch.setattr(memory, "check_fits", real)
    monkeypatch.setattr(memory, "free_bytes", lambda device: nbytes - 1)
    with pytest.raises(ds4jax.errors.DeviceMemoryError, match="out of memory before allocating the weights in the "
                                                              "checkpoint's formats"):
        ds4jax.load(directory, jnp.float32, weights="checkpoint")


@pytest.mark.parametrize("quantize", ["fp8", "fp4"])
def test_a_non_finite_weight_is_not_quantized_and_nothing_is_left_half_written(official, tmp_path, quantize):
    """An Inf made its block's E8M0 scale 2^127, the value NaN and the rest of the block 0, and was written as is.
    Now `save(..., quantize=)` names the tensor, and the shards already written are removed with the directory
    it created (a failure mid-save, e.g. a full disk, left them behind)."""
    import dataclasses

    source, _ = official
    params = jax.tree.map(np.array, source.unrolled().params)  # writable host copies
    params["layers"][1]["ffn"]["experts"]["w2"][3, 5, 7] = np.inf  # late in the file order: shards come first
    bad = dataclasses.replace(source.unrolled(), params=params)
    out = tmp_path / "quantized"
    with pytest.raises(ds4jax.errors.ArgumentError, match=rf"layers\.1\.ffn\.experts\.3\.w2\.weight: holds inf at "
                                                          rf"index \[7, 5\]: {quantize.upper()} cannot encode"):
        ds4jax.save(bad, out, quantize=quantize, max_shard_bytes=4096)
    assert not out.exists()
