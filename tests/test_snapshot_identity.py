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
    np.testing.assert_array_equal(np.asarray(snapshots._digests([x], rows=(None,))),
                                  np.asarray(snapshots._digests([sharded], rows=(None,))))


def test_a_hash_collision_never_restores_another_prefix(monkeypatch):
    monkeypatch.setattr(snapshots, "ids_key", lambda ids: ("every prefix collides", len(ids)))
    store = SnapshotStore(1 << 20)
    store.put(Snapshot((5, 6, 7), {}, {"last_logits": np.zeros(4, np.float32)}, pages=0))
    assert store.longest_prefix([5, 6, 8, 9]) is None  # same key, other ids
    assert store.longest_prefix([5, 6, 7, 9]).ids == (5, 6, 7)
