"""Orbax checkpoints (`ds4jax.io.orbax_checkpoint`) and ``ds4jax convert`` in both directions, including an
interrupted conversion that must leave nothing loadable."""

from __future__ import annotations

import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ds4jax
from ds4jax.cli import main
from ds4jax.io import checkpoint, convert, orbax_checkpoint
from ds4jax.model import params as P
from ds4jax.model.handle import Model


@pytest.fixture(autouse=True)
def no_persistent_cache(monkeypatch):
    monkeypatch.setenv("DS4JAX_COMPILATION_CACHE", "off")


@pytest.fixture(scope="module")
def model():
    cfg = ds4jax.tiny()
    return Model(cfg, P.init(cfg, jax.random.key(3), jnp.float32))


@pytest.fixture(scope="module")
def safetensors_dir(model, tmp_path_factory):
    d = tmp_path_factory.mktemp("st") / "ckpt"
    ds4jax.save(model, d)
    (d / "tokenizer.json").write_text("{}")
    return d


def same_params(a, b):
    chex.assert_trees_all_equal_structs(a, b)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
    jax.tree.map(lambda x, y: chex.assert_equal(x.dtype, y.dtype), a, b)


def test_orbax_round_trip_keeps_every_leaf(model, tmp_path):
    orbax_checkpoint.save(model, tmp_path / "o")
    assert orbax_checkpoint.is_orbax(tmp_path / "o")
    same_params(ds4jax.load(tmp_path / "o", dtype=jnp.float32).params, model.params)
    bf16 = ds4jax.load(tmp_path / "o", dtype=jnp.bfloat16)
    assert bf16.params["embed"].dtype == jnp.bfloat16 and bf16.params["norm"].dtype == jnp.float32
    assert bf16.params["layers"][0]["ffn"]["tid2eid"].dtype == jnp.int32


def test_convert_both_ways_via_cli(model, safetensors_dir, tmp_path, capsys):
    assert main(["convert", str(safetensors_dir), str(tmp_path / "o")]) == 0
    assert "orbax" in capsys.readouterr().out
    assert convert.source_format(str(tmp_path / "o")) == "orbax"
    assert (tmp_path / "o" / "tokenizer.json").exists()  # extras travel along
    same_params(ds4jax.load(tmp_path / "o", dtype=jnp.float32).params, model.params)
    assert main(["convert", str(tmp_path / "o"), str(tmp_path / "s")]) == 0
    assert convert.source_format(str(tmp_path / "s")) == "safetensors"
    same_params(ds4jax.load(tmp_path / "s", dtype=jnp.float32).params, model.params)
    assert main(["convert", str(tmp_path / "o"), str(tmp_path / "s")]) == 2  # exists, no --overwrite
    assert main(["convert", str(tmp_path / "o"), str(tmp_path / "s"), "--overwrite", "--dtype", "bfloat16"]) == 0
    assert ds4jax.load(tmp_path / "s", dtype=jnp.float32).params["embed"].dtype == jnp.float32
    assert convert.source_dtype(str(tmp_path / "s")) == jnp.bfloat16


def loadable(directory) -> bool:
    try:
        ds4jax.load(directory, dtype=jnp.float32)
        return True
    except Exception:
        return False


@pytest.mark.parametrize("to", ["orbax", "safetensors"])
def test_interrupted_convert_leaves_nothing_loadable(safetensors_dir, tmp_path, monkeypatch, to):
    """The weights are fully written, then the process is interrupted before the conversion finishes."""
    src = safetensors_dir
    if to == "safetensors":
        convert.convert(safetensors_dir, tmp_path / "src")
        src = tmp_path / "src"
    real = orbax_checkpoint.write_params if to == "orbax" else checkpoint.save

    def write_then_interrupt(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(orbax_checkpoint if to == "orbax" else checkpoint,
                        "write_params" if to == "orbax" else "save", write_then_interrupt)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        convert.convert(src, out, to=to)
    assert not out.exists()
    leftovers = [p for p in tmp_path.iterdir() if p.name != "src"]
    assert not [p for p in leftovers if loadable(p)], leftovers


def test_orbax_mismatch_names_the_tensor(model, tmp_path):
    orbax_checkpoint.save(model, tmp_path / "o")
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    cfg["moe_intermediate_size"] = 48
    (tmp_path / "o" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ds4jax.CheckpointError, match=r"experts\.w1 has shape"):
        ds4jax.load(tmp_path / "o")


def test_orbax_without_mtp_loads_without_mtp(model, tmp_path):
    bare = Model(model.config, {k: v for k, v in model.params.items() if k != "mtp"})
    orbax_checkpoint.save(bare, tmp_path / "o")
    loaded = ds4jax.load(tmp_path / "o", dtype=jnp.float32)
    assert not loaded.has_mtp
    with pytest.raises(ds4jax.CheckpointError, match="exists"):
        orbax_checkpoint.save(bare, tmp_path / "o")
    orbax_checkpoint.save(model, tmp_path / "o", overwrite=True)
    assert ds4jax.load(tmp_path / "o", dtype=jnp.float32).has_mtp
    assert sorted(os.listdir(tmp_path)) == ["o"]  # no temporary directories left behind


def test_orbax_loads_from_a_relative_path(model, tmp_path, monkeypatch):
    orbax_checkpoint.save(model, tmp_path / "o")
    monkeypatch.chdir(tmp_path)
    assert ds4jax.load("o", dtype=jnp.float32).has_mtp
