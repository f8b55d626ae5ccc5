"""ds4jax.load(path, mesh=...): each device's block read straight from the safetensors files (bytes counted)."""

import json
import os
import struct
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import ds4jax
from ds4jax.io import checkpoint
from ds4jax.io.sharded_load import ReadCounter, load_sharded
from ds4jax.model import params as params_lib
from ds4jax.model.handle import Model
from ds4jax.runtime.mesh import MeshError, make_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices")


def tensor_bytes(directory) -> dict[str, int]:
    out = {}
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            with open(os.path.join(directory, name), "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            out.update({k: v["data_offsets"][1] - v["data_offsets"][0]
                        for k, v in header.items() if k != "__metadata__"})
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    # expert FFN width 64: its halves are whole FP4 32-column groups (Flash: 2048 over tensor 2 -> 32 groups each)
    cfg = ds4jax.tiny(num_heads=4, o_groups=4, moe_intermediate_size=64)
    model = Model(cfg, params_lib.init(cfg, jax.random.key(3)))
    directory = tmp_path_factory.mktemp("plain")
    ds4jax.save(model, directory)
    return cfg, str(directory)


def assert_same(a, b):
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def test_every_byte_read_once_and_only_by_its_shard(saved):
    cfg, directory = saved
    layout = make_mesh(expert=2, tensor=2)
    counter = ReadCounter()
    model = load_sharded(directory, jnp.float32, layout, progress=False, counter=counter)
    assert model.layout is layout
    assert_same(model.params, checkpoint.load(directory, jnp.float32).params)
    # nothing read twice, nothing read that is not a parameter: the bytes read are the file's tensor bytes
    assert dict(counter.by_tensor) == tensor_bytes(directory)
    # each read of a routed expert is one device's block: half the experts, half the FFN columns
    expert = "layers.0.ffn.experts.0.w1.weight"
    reads = [(idx, n) for key, idx, n in counter.reads if key == expert]
    f, e = cfg.moe_intermediate_size, cfg.hidden_size
    assert [n for _, n in reads] == [f // 2 * e * 4] * 2  # expert 0 lives on one expert shard: 2 column halves
    w1 = model.params["layers"][0]["ffn"]["experts"]["w1"]
    assert {s.data.shape for s in w1.addressable_shards} == {(cfg.num_routed_experts // 2, e, f // 2)}


def test_quantized_blocks_dequantized_per_slice(saved, tmp_path):
    from test_checkpoint import quantize_checkpoint, write_checkpoint

    cfg, directory = saved
    sd = {}
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            sd.update(load_file(os.path.join(directory, name)))
    tensors, _ = quantize_checkpoint(sd, block=(16, 16))  # FP8 linears (16x16 blocks), FP4 experts
    config = {**cfg.to_hf_dict(), "quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}}
    qdir = write_checkpoint(tmp_path / "q", cfg, tensors, config=config)
    counter = ReadCounter()
    layout = make_mesh(expert=2, tensor=2)
    model = ds4jax.load(qdir, jnp.float32, mesh=layout)
    assert_same(model.params, checkpoint.load(qdir, jnp.float32).params)
    load_sharded(qdir, jnp.float32, layout, progress=False, counter=counter)
    files = tensor_bytes(qdir)
    # FP4 experts split on whole 32-column groups and FP8 on whole blocks here: still every byte exactly once
    assert dict(counter.by_tensor) == files
    out = ds4jax.forward_logits(model, np.arange(12)[None] % cfg.vocab_size)
    ref = ds4jax.forward_logits(checkpoint.load(qdir, jnp.float32), np.arange(12)[None] % cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))


def test_bad_layer_split_fails_before_reading(saved):
    _, directory = saved
    with pytest.raises(MeshError, match="exactly once"):
        ds4jax.load(directory, jnp.float32, mesh=make_mesh(layer_split=[(0, 1), (2, 3)]))


def test_orbax_restores_into_shards(saved, tmp_path):
    from ds4jax.io import orbax_checkpoint

    cfg, directory = saved
    model = checkpoint.load(directory, jnp.float32)
    orbax_checkpoint.save(model, tmp_path / "orbax")
    layout = make_mesh(expert=2, tensor=2)
    placed = ds4jax.load(tmp_path / "orbax", jnp.float32, mesh=layout)
    assert placed.layout is layout
    assert_same(placed.params, model.params)
    w1 = placed.params["layers"][0]["ffn"]["experts"]["w1"]
    assert w1.sharding == layout.param_shardings(cfg)["layers"][0]["ffn"]["experts"]["w1"]
    assert {s.data.shape[0] for s in w1.addressable_shards} == {cfg.num_routed_experts // 2}
