"""The pool layout table is the one description of the pools: KVPool, shapes, logical axes, roles and the steps'
per-layer views all follow it, and a step updates paged pools in place (no layer slice copied out and back)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ds4jax.model.config import AttentionType
from ds4jax.runtime import pool_layout as layout
from ds4jax.runtime import pools, steps
from ds4jax.runtime.pool_spec import shapes
from ds4jax.runtime.pooled_attention import LayerPools
from ds4jax.runtime.roles import Role
from steps_helpers import CFG, DRAFT_SPEC, SPEC


def test_kvpool_and_shapes_follow_the_table():
    assert [k for k in vars(pools.zeros(SPEC))] == list(layout.NAMES) == list(shapes(SPEC))
    for a in layout.POOL_ARRAYS:
        assert len(a.shape) == len(a.axes), a.name
        assert shapes(SPEC)[a.name][0] == tuple(getattr(SPEC, f) for f in a.shape)
    # every per-layer field of the table is a LayerPools field, and every LayerPools field comes from the table
    assert set(layout.LAYER_FIELDS) == set(LayerPools._fields)


@pytest.mark.parametrize("spec, role", [(SPEC, Role.TARGET), (DRAFT_SPEC, Role.DRAFT)], ids=["target", "draft"])
def test_roles_and_logical_axes(spec, role):
    pool = pools.abstract(spec)
    specs = pools.logical_specs()
    for a in layout.POOL_ARRAYS:
        arr = getattr(pool, a.name)
        assert len(getattr(specs, a.name)) == arr.ndim == len(a.axes)
        if role not in a.roles:
            assert np.prod(arr.shape) == 0, f"{a.name} is not used by {role} but has capacity"
    assert pools.logical_specs().swa_kv == jax.sharding.PartitionSpec("pool_layers", "slots", "swa_rows", "kv_dim")
    assert pools.logical_specs().c4_kv == jax.sharding.PartitionSpec("pool_layers", "entries", "kv_dim")


def test_layer_kinds_and_indices():
    kinds = (AttentionType.CSA, AttentionType.HCA, AttentionType.CSA)
    assert {a.name for a in layout.of_layer(AttentionType.SLIDING)} == {"swa_kv", "swa_kv_scale"}
    assert {a.name for a in layout.of_layer(AttentionType.HCA)} == {"swa_kv", "c128_kv", "c128_state_kv",
                                                                    "c128_state_gate", "swa_kv_scale", "c128_kv_scale"}
    c4, c128, swa = layout.BY_NAME["c4_kv"], layout.BY_NAME["c128_kv"], layout.BY_NAME["swa_kv"]
    assert [layout.layer_index(kinds, i, swa) for i in range(3)] == [0, 1, 2]
    assert layout.layer_index(kinds, 2, c4) == 1 and layout.layer_index(kinds, 1, c128) == 0
    table = layout.format_table(SPEC)
    assert all(f"| {n} |" in table for n in layout.NAMES) and "pool_layers, entries, kv_dim" in table


def test_decode_updates_paged_pools_in_place():
    """The compiled decode step never materialises one layer of a paged pool ([entries, width]): attention and
    the indexer read the whole pool in place and new entries are scattered into it."""
    from ds4jax.model import params as P

    params = jax.eval_shape(lambda k: P.init(CFG, k, jnp.float32), jax.random.key(0))
    batch = steps.StepBatch(jax.ShapeDtypeStruct((2,), jnp.int32), jax.ShapeDtypeStruct((2, 1), jnp.int32),
                            jax.ShapeDtypeStruct((2,), jnp.int32))
    hlo = steps._target_step.lower(params, pools.abstract(SPEC), batch, cfg=CFG, spec=SPEC, role=Role.TARGET,
                                   logits=steps.Logits.LAST, kernels=steps.resolve("reference")).as_text()
    assert SPEC.num_csa_layers == 2  # (with one layer, the whole pool would have a layer's shape)
    for name, rows, width in (("c4_kv", SPEC.c4_entries, SPEC.head_dim),
                              ("indexer_kv", SPEC.indexer_entries, SPEC.index_head_dim)):
        layer_slice = re.findall(rf"tensor<{rows}x{width}xf32>", hlo)
        assert not layer_slice, f"a layer of {name} ([{rows}, {width}]) is materialised {len(layer_slice)} times"
