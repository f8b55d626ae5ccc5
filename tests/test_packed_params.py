"""Our packed format (`ds4jax.io.packed_params`, what checkpoints/default ships in): the same model as an Orbax copy
of it, bit for bit, in every compute dtype and tree layout; ``ds4jax convert`` writes and reads it; a header that
does not match the config, or a file without our metadata, is refused before any data is read."""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ds4jax.errors import CheckpointError
from ds4jax.io import checkpoint, convert, packed_params
from ds4jax.io import default_model as dm

CKPT = dm.SHIPPED
pytestmark = pytest.mark.skipif(not packed_params.is_packed(CKPT), reason="checkpoints/default is not present")


@pytest.fixture(autouse=True)
def no_persistent_cache(monkeypatch):
    monkeypatch.setenv("DS4JAX_COMPILATION_CACHE", "off")


@pytest.fixture(scope="module")
def orbax_copy(tmp_path_factory):
    dst = tmp_path_factory.mktemp("orbax") / "o"
    assert convert.convert(CKPT, dst, to="orbax") == "orbax"
    return dst


def _same(a, b):
    (la, ta), (lb, tb) = jax.tree_util.tree_flatten_with_path(a.params), jax.tree_util.tree_flatten_with_path(b.params)
    assert ta == tb and a.config == b.config
    for (path, x), (_, y) in zip(la, lb):
        assert (x.dtype, x.shape, x.sharding) == (y.dtype, y.shape, y.sharding), jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])  # widening, as stored, narrowing
def test_packed_loads_what_its_orbax_copy_loads(orbax_copy, dtype):
    _same(checkpoint.load(CKPT, dtype=dtype), checkpoint.load(orbax_copy, dtype=dtype))


def test_unstacked_layers_too(orbax_copy, monkeypatch):
    monkeypatch.setenv("DS4JAX_SCAN_LAYERS", "0")  # the per-layer tree, no host stacking
    _same(checkpoint.load(CKPT, dtype=jnp.float32), checkpoint.load(orbax_copy, dtype=jnp.float32))


def test_convert_round_trip_keeps_every_byte(orbax_copy, tmp_path):
    assert convert.convert(orbax_copy, tmp_path / "p", to="packed") == "packed"
    assert convert.source_format(str(tmp_path / "p")) == "packed"
    a = load_file(os.path.join(CKPT, packed_params.PARAMS_FILE))
    b = load_file(str(tmp_path / "p" / packed_params.PARAMS_FILE))
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        np.testing.assert_array_equal(a[name].view(np.uint8), b[name].view(np.uint8))


def _edited(tmp_path, edit, metadata=None):
    dst = tmp_path / "c"
    dst.mkdir(parents=True)
    shutil.copy(os.path.join(CKPT, "config.json"), dst)
    tensors = load_file(os.path.join(CKPT, packed_params.PARAMS_FILE))
    edit(tensors)
    save_file(tensors, str(dst / packed_params.PARAMS_FILE),
              metadata={"format": packed_params.FORMAT} if metadata is None else metadata)
    return dst


def test_wrong_shape_missing_tensor_and_foreign_file_are_refused(tmp_path):
    def reshape(t):
        t["layers.0.attn.wq_a"] = t["layers.0.attn.wq_a"][:-1]

    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wq_a has shape"):
        checkpoint.load(_edited(tmp_path / "a", reshape))
    with pytest.raises(CheckpointError, match=r"missing \['embed'\]"):
        checkpoint.load(_edited(tmp_path / "b", lambda t: t.pop("embed")))
    with pytest.raises(CheckpointError, match="not a packed params file"):
        checkpoint.load(_edited(tmp_path / "c", lambda t: None, metadata={"format": "pt"}))
