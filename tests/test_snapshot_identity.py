"""What keeps a snapshot from restoring the wrong state: its model fingerprint covers every element of every
weight (changing any single element of any tensor changes it, so a fine-tune that differs only in a late layer
cannot restore another model's state) whatever the weights' placement, and a store lookup compares the exact ids
(a hash collision finds nothing)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import ds4jax
from ds4jax.generation import snapshots
from ds4jax.generation.snapshots import Snapshot, SnapshotStore
from ds4jax.runtime.roles import Role
from spec_helpers import agreeable_model, tiny3


def test_any_changed_element_changes_the_model_fingerprint():
    model = agreeable_model(tiny3(), seed=0, damp=0.3, stream_gain=2.0)
    spec = ds4jax.configure(model.config, role=Role.TARGET, max_slots=2, max_context=64)
    base = snapshots.fingerprint(model, spec, None)
    leaves, treedef = jax.tree.flatten(model.params)
    same = []
    for i, leaf in enumerate(leaves):
        for at in (0, leaf.size - 1):  # the first and the last element of every tensor
            changed = list(leaves)
            flat = leaf.reshape(-1)
            changed[i] = flat.at[at].set(flat[at] + 1 if flat.dtype != jnp.bool_ else ~flat[at]).reshape(leaf.shape)
            fp = snapshots.fingerprint(ds4jax.Model(model.config, jax.tree.unflatten(treedef, changed)), spec, None)
            if fp["model"] == base["model"]:
                same.append((jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(model.params)[0][i][0]), at))
            assert {k: v for k, v in fp.items() if k != "model"} == {k: v for k, v in base.items() if k != "model"}
    assert not same, f"changed elements the fingerprint did not see: {same[:5]}"


def test_the_digest_does_not_depend_on_sharding():
    x = jax.random.normal(jax.random.key(0), (8, 16, 6))
    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    sharded = jax.device_put(x, NamedSharding(mesh, PartitionSpec("a", "b")))
    np.testing.assert_array_equal(np.asarray(snapshots._digests([x], stacked=(False,))),
                                  np.asarray(snapshots._digests([sharded], stacked=(False,))))


def test_a_hash_collision_never_restores_another_prefix(monkeypatch):
    monkeypatch.setattr(snapshots, "ids_key", lambda ids: ("every prefix collides", len(ids)))
    store = SnapshotStore(1 << 20)
    store.put(Snapshot((5, 6, 7), {}, {"last_logits": np.zeros(4, np.float32)}, pages=0))
    assert store.longest_prefix([5, 6, 8, 9]) is None  # same key, other ids
    assert store.longest_prefix([5, 6, 7, 9]).ids == (5, 6, 7)


def test_the_host_digest_equals_the_device_program():
    """Small weights are digested in numpy (no program to compile), large ones on the device: the same numbers for
    every dtype a checkpoint holds, whole leaves and the rows of a stacked one, so fingerprints agree either way."""
    key = jax.random.key(3)
    floats = [jax.random.normal(key, (3, 5, 7)).astype(d)
              for d in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e4m3fnuz)]
    arrays = floats + [jax.random.randint(key, (4, 9), 0, 255).astype(jnp.uint8),
                       jax.random.randint(key, (2, 3), -9, 9).astype(jnp.int8),
                       jax.random.bernoulli(key, 0.5, (6,)), jnp.float32(3.0),
                       jnp.full((2, 4), 2.0 ** -3).astype(jnp.float8_e8m0fnu)]
    stacked = (True, True, False, False, True, False, True, False, False, True)
    device = np.asarray(snapshots._digests(arrays, stacked=stacked))
    host = np.concatenate([snapshots._host_rows_digest(np.asarray(x) if s else np.asarray(x)[None])
                           for x, s in zip(arrays, stacked)])
    np.testing.assert_array_equal(host, device)


def test_small_weights_are_fingerprinted_on_the_host(monkeypatch):
    model = agreeable_model(tiny3(), seed=1, damp=0.3, stream_gain=2.0)
    spec = ds4jax.configure(model.config, role=Role.TARGET, max_slots=2, max_context=64)
    monkeypatch.setattr(snapshots, "_HOST_DIGEST_BYTES", 0)
    on_device = snapshots.fingerprint(model, spec, None)
    monkeypatch.setattr(snapshots, "_HOST_DIGEST_BYTES", 256 << 20)

    def no_program(*args, **kwargs):
        raise AssertionError("small weights compiled the digest program")

    monkeypatch.setattr(snapshots, "_digests", no_program)
    assert snapshots.fingerprint(model, spec, None) == on_device
