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


def _mhc_fn(name: str) -> bool:
    return name.rsplit(".", 1)[-1] == "fn"


def test_convert_round_trip_keeps_every_byte(orbax_copy, tmp_path):
    """Every byte but the layout of the mHC fn, which the shipped file keeps from before it changed (each then
    written as [outputs, m*e], the same bytes transposed)."""
    assert convert.convert(orbax_copy, tmp_path / "p", to="packed") == "packed"
    assert convert.source_format(str(tmp_path / "p")) == "packed"
    a = load_file(os.path.join(CKPT, packed_params.PARAMS_FILE))
    b = load_file(str(tmp_path / "p" / packed_params.PARAMS_FILE))
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        want = np.ascontiguousarray(a[name].T) if _mhc_fn(name) else a[name]
        np.testing.assert_array_equal(want.view(np.uint8), b[name].view(np.uint8), err_msg=name)


def test_the_mhc_fn_of_an_earlier_layout_is_transposed_on_load(orbax_copy, tmp_path):
    """checkpoints/default (packed) stores every mHC fn as [m*e, outputs], the layout before round 3's session 31;
    an Orbax checkpoint of that time did too. Both load into [outputs, m*e] and the same model as the current
    layout; a leaf that is neither layout is still refused."""
    import orbax.checkpoint as ocp

    from ds4jax.io import orbax_checkpoint

    legacy = {name: shape for name, (shape, _) in packed_params.stored_metadata(CKPT).items() if _mhc_fn(name)}
    assert legacy and all(shape[0] > shape[1] for shape in legacy.values()), legacy  # the old layout, every one
    current = checkpoint.load(orbax_copy, dtype=jnp.float32)
    assert current.params["hc_head"]["fn"].shape == legacy["hc_head.fn"][::-1]
    _same(checkpoint.load(CKPT, dtype=jnp.float32), current)

    # an Orbax checkpoint in the earlier layout: the current copy's tree with every fn transposed back
    old = tmp_path / "old"
    shutil.copytree(orbax_copy, old, ignore=shutil.ignore_patterns(orbax_checkpoint.PARAMS_DIR))
    tree = jax.tree_util.tree_map_with_path(
        lambda kp, a: np.ascontiguousarray(np.asarray(a).T) if kp[-1].key == "fn" else np.asarray(a),
        load_file_tree(orbax_copy))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(os.path.abspath(old), orbax_checkpoint.PARAMS_DIR), tree)
        ckptr.wait_until_finished()
    _same(checkpoint.load(old, dtype=jnp.float32), current)

    def square_off(tensors):  # neither [outputs, m*e] nor its transpose
        tensors["hc_head.fn"] = tensors["hc_head.fn"][:8]
    with pytest.raises(CheckpointError, match="hc_head.fn"):
        checkpoint.load(_edited(tmp_path, square_off), dtype=jnp.float32)


def load_file_tree(orbax_dir):
    """The per-layer params tree stored in an Orbax checkpoint, as numpy arrays."""
    import orbax.checkpoint as ocp

    from ds4jax.io import orbax_checkpoint

    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(os.path.join(os.path.abspath(orbax_dir), orbax_checkpoint.PARAMS_DIR))


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
