"""A layer split's stages run their repeated layers under `lax.scan` (issue 22).

CFG's second stage, layers 2..5, is the unit ((HCA, top-k), (CSA, top-k)) twice: with ``DS4JAX_SCAN_MIN_REPEATS=2``
its program holds one scan (one body per unit member), the first stage (two different layers) none. Cheap on
purpose (tests/test_mesh.py runs the split engines): one traced stage program, and a few pooled steps of a
two-layer-wide model on two host devices, scanned against unrolled on NaN-poisoned pools (a stage-local pool row
computed wrongly under the scan would read poison or another layer's rows)."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from ds4jax.model import layer_stack, params as params_lib
from ds4jax.model.config import AttentionType as A, MlpType as M, tiny
from ds4jax.model.handle import Model
from ds4jax.runtime import pools, steps
from ds4jax.runtime.mesh import make_mesh, place_model
from ds4jax.runtime.mesh_steps import gather_pools, stage_config, stage_step
from ds4jax.runtime.pool_spec import PoolSpec
from ds4jax.runtime.roles import Role

S, C, H = A.SLIDING, A.CSA, A.HCA
CFG = tiny(num_layers=6, attention_types=(S, C, H, C, H, C), mlp_types=(M.HASH,) * 2 + (M.TOPK,) * 4)
SPLIT = ((0, 2), (2, 6))
CHUNK = 8


@pytest.fixture(scope="module")
def models():
    """(scanned, unrolled) models placed on the split, planned with scans of two repetitions."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DS4JAX_SCAN_MIN_REPEATS", "2")
        layout = make_mesh(layer_split=SPLIT, devices=jax.devices()[:2])
        params = params_lib.init(CFG, jax.random.key(5), jnp.float32)
        yield (place_model(Model(CFG, params), layout), place_model(Model(CFG, params, scan_layers=False), layout),
               layout)


def _count(jaxpr, name: str) -> int:
    return sum((e.primitive.name == name) + sum(_count(getattr(s, "jaxpr", s), name)
                                                for s in jax.extend.core.jaxprs_in_params(e.params))
               for e in jaxpr.eqns)


def test_flash_on_four_stages_scans_in_every_stage():
    """Flash's 43 layers in 4 stages: each stage's plan (3-repetition rule) has one scanned segment of its own."""
    from ds4jax.model.config import flash
    from ds4jax.runtime.mesh import split_ranges

    ranges = split_ranges(4, 43, 4)
    segs = layer_stack.plan_stages(layer_stack.kinds(flash()), ranges, min_reps=3)
    scanned = [(s.start, s.period, s.repeats) for s in segs if s.repeats > 1]
    assert scanned == [(3, 2, 4), (11, 2, 5), (22, 2, 5), (32, 2, 5)], segs
    assert all(lo <= s.start and s.stop <= hi for s in segs for lo, hi in ranges if lo <= s.start < hi)


def test_stage_params_are_stacked_per_stage(models):
    scanned, unrolled, layout = models
    stack = scanned.params["layers"]
    assert [(s.start, s.period, s.repeats) for s in stack.segments] == [(0, 1, 1), (1, 1, 1), (2, 2, 2)]
    second = layer_stack.layer_range(stack, *SPLIT[1])
    assert isinstance(second, layer_stack.LayerStack) and second.groups[0] is stack.groups[2]  # shared arrays
    assert [(s.start, s.period, s.repeats) for s in second.segments] == [(0, 2, 2)]
    # a stacked leaf lives on its stage's devices, its layer axis replicated
    leaf = stack.groups[2][0]["attn"]["wq_a"]
    assert leaf.sharding.device_set == set(layout.stages[1].devices.flat)
    assert isinstance(unrolled.params["layers"], list)
    # a model stacked for another split is restacked for this one when placed (its stack would cross stage 2)
    other = place_model(Model(CFG, layer_stack.unstacked_params(scanned.params)),
                        make_mesh(layer_split=((0, 3), (3, 6)), devices=jax.devices()[:2]))
    assert [(s.start, s.repeats) for s in other.params["layers"].segments] == [(i, 1) for i in range(6)]
    for a, b in zip(jax.tree.leaves(layer_stack.unstack(other.params["layers"])),
                    jax.tree.leaves(unrolled.params["layers"])):
        np.testing.assert_array_equal(a, b)


def test_stage_program_scans(models):
    scanned, unrolled, layout = models
    spec = PoolSpec.for_role(CFG, role=Role.TARGET, max_slots=2, max_context=32, page_size=8, dtype="float32")
    sspec = layout.steps(CFG).stage_specs(spec)[1]
    batch = steps.StepBatch(*(jax.ShapeDtypeStruct(s, jnp.int32) for s in ((2,), (2, 1), (2,))))
    x = jax.ShapeDtypeStruct((2, 1, CFG.hc_mult, CFG.hidden_size), jnp.float32)

    def jaxpr(model):
        layers = layer_stack.layer_range(model.params["layers"], *SPLIT[1])
        with layout.active(1):
            return jax.make_jaxpr(lambda p, pool, b, x: stage_step(
                {"layers": p}, pool, b, x, cfg=stage_config(CFG, *SPLIT[1]), spec=sspec, rules=layout.rules,
                logits=steps.Logits.NONE, kernels=None))(layers, pools.abstract(sspec), batch, x).jaxpr

    a, b = jaxpr(scanned), jaxpr(unrolled)
    # the stage's four layers as one scan over the two-layer unit: the scan, and half the layers' equations (a
    # layer's own scans, its matmuls) traced once in its body; unrolled, all four layers'
    assert _count(b, "scan") % 4 == 0 and _count(a, "scan") == 1 + _count(b, "scan") // 2
    assert 2 * _count(a, "dot_general") == _count(b, "dot_general")


def _run(model, layout):
    """Two prefill chunks, then two one-token steps (one program per stage), on poisoned pools: last logits of
    each step, the greedy tokens and the pools."""
    spec = PoolSpec.for_role(CFG, role=Role.TARGET, max_slots=2, max_context=32, page_size=8, dtype="float32")
    mesh_steps = layout.steps(CFG)
    book = mesh_steps.book(spec, CFG.vocab_size)
    poisoned = tuple(jax.device_put(pools.poisoned(sp), sh)
                     for sp, sh in zip(mesh_steps.stage_specs(spec), mesh_steps.pool_shardings(spec)))
    slots = [book.admit() for _ in range(2)]
    for s in slots:
        book.reserve(s, 24)
    pool = mesh_steps.sync(book, poisoned, spec)
    prompts = np.random.default_rng(6).integers(0, CFG.vocab_size, (2, 13)).astype(np.int32)
    chunks = [(prompts[:, :8], [8, 8]), (np.pad(prompts[:, 8:], ((0, 0), (0, 3))), [5, 5])]
    logits, tokens = [], []
    for step in range(4):
        tok, n = chunks[step] if step < 2 else (np.pad(tokens[-1][:, None], ((0, 0), (0, CHUNK - 1))), [1, 1])
        batch = steps.StepBatch(jnp.asarray(slots, jnp.int32), jnp.asarray(tok, jnp.int32), jnp.asarray(n, jnp.int32))
        out, pool = mesh_steps.prefill(model.params, pool, batch, cfg=CFG, spec=spec)
        book.commit(slots, n)
        logits.append(np.asarray(out.logits))
        tokens.append(np.argmax(logits[-1], -1).astype(np.int32))
    return np.stack(logits), np.stack(tokens), gather_pools(pool, mesh_steps, spec)


def test_scanned_stages_equal_unrolled(models):
    scanned, unrolled, layout = models
    la, ta, pa = _run(scanned, layout)
    lb, tb, pb = _run(unrolled, layout)
    assert np.isfinite(la).all()
    np.testing.assert_allclose(la, lb, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(ta, tb)
    for name in pa:
        np.testing.assert_allclose(pa[name], pb[name], rtol=1e-5, atol=1e-5, equal_nan=True, err_msg=name)
    # the cache-free forward on the split (`layer_split`: a stage's LayerStack run at its model layer offset)
    ids = jnp.asarray(np.random.default_rng(7).integers(0, CFG.vocab_size, (1, 12)), jnp.int32)
    np.testing.assert_allclose(layout.forward_logits(scanned, ids), layout.forward_logits(unrolled, ids),
                               rtol=1e-5, atol=1e-5)


def test_sharded_load_onto_the_split_stacks_by_stage(models, tmp_path):
    """`ds4jax.load(..., mesh=split)` reads per-layer blocks onto each stage's devices, then stacks them there."""
    import ds4jax

    scanned, _, layout = models
    ds4jax.save(scanned, tmp_path / "ckpt")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DS4JAX_SCAN_MIN_REPEATS", "2")
        loaded = ds4jax.load(tmp_path / "ckpt", jnp.float32, mesh=layout)
    assert loaded.params["layers"].segments == scanned.params["layers"].segments
    assert jax.tree.structure(loaded.params) == jax.tree.structure(scanned.params)
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(scanned.params)):
        assert a.sharding == b.sharding  # equal, not only equivalent: a program compiled for one serves the other
        np.testing.assert_array_equal(a, b)
