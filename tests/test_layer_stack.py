"""Layers under `lax.scan` (issue 22): the segment plan, the stacked layout, and scanned == unrolled.

CFG has the shape of the published schedules (and of the default model): single (SWA, hash) and (CSA, hash) layers,
then a two-layer unit ((HCA, top-k), (CSA, top-k)) repeated twice, which the suite scans (DS4JAX_SCAN_MIN_REPEATS=2,
conftest.py; the library's rule of 3 repetitions is tested on the schedules themselves). Six layers, not more:
the unrolled side compiles one body per layer."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import ds4jax
from ds4jax.generation.generate import SamplingParams
from ds4jax.model import forward as forward_lib
from ds4jax.model import layer_stack, params as params_lib
from ds4jax.model.config import AttentionType as A, MlpType as M, flash, pro, tiny
from ds4jax.model.handle import Model
from ds4jax.runtime import pools, steps
from ds4jax.runtime.pool_spec import PoolSpec
from ds4jax.runtime.roles import Role

S, C, H = A.SLIDING, A.CSA, A.HCA
CFG = tiny(num_layers=6, attention_types=(S, C) + (H, C) * 2, mlp_types=(M.HASH,) * 2 + (M.TOPK,) * 4)
EIGHT = ((S, M.HASH), (C, M.HASH)) + ((H, M.TOPK), (C, M.TOPK)) * 3  # CFG's schedule with three repetitions


@pytest.fixture(scope="module")
def models():
    params = params_lib.init(CFG, jax.random.key(3), jnp.float32)
    return Model(CFG, params), Model(CFG, params, scan_layers=False)


def test_plan_of_the_published_schedules(monkeypatch):
    monkeypatch.delenv("DS4JAX_SCAN_MIN_REPEATS", raising=False)  # the library's rule (the suite sets 2: conftest)
    assert layer_stack.min_repeats() == 3
    segs = layer_stack.plan(layer_stack.kinds(flash()))
    assert [(s.start, s.period, s.repeats) for s in segs] == [(0, 1, 1), (1, 1, 1), (2, 1, 1), (3, 2, 20)]
    assert segs[-1].unit == ((H, M.TOPK), (C, M.TOPK)) and segs[-1].stop == 43
    segs = layer_stack.plan(layer_stack.kinds(pro()))
    assert sum(s.period * s.repeats for s in segs) == 61
    bodies = {k for s in segs for k in s.unit}
    assert len(segs) <= 5 and len(bodies) <= 4, segs  # one body per layer kind, whatever the depth
    assert [(s.start, s.period, s.repeats) for s in layer_stack.plan(EIGHT)] == [(0, 1, 1), (1, 1, 1), (2, 2, 3)]
    # by the library's rule two repetitions stay unrolled unless asked for
    assert layer_stack.kinds(CFG) == EIGHT[:6]
    assert [s.repeats for s in layer_stack.plan(EIGHT[:6])] == [1] * 6
    assert [s.repeats for s in layer_stack.plan(EIGHT[:6], min_reps=2)] == [1, 1, 2]
    assert [s.repeats for s in layer_stack.plan([(S, M.HASH)] * 3, min_reps=3)] == [3]  # one-layer units too


def _same(a, b) -> bool:
    """Two trees hold equal arrays (compared on the host: a jnp comparison compiles per leaf shape)."""
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_stack_round_trip_and_indexing(models):
    scanned, unrolled = models
    stack = scanned.params["layers"]
    assert isinstance(stack, layer_stack.LayerStack) and isinstance(unrolled.params["layers"], list)
    assert len(stack) == CFG.num_layers
    for i, layer in enumerate(unrolled.params["layers"]):
        assert _same(stack.layer(i), layer), i
        assert np.array_equal(stack[i]["attn"]["wq_a"], layer["attn"]["wq_a"])
    with pytest.raises(Exception, match="immutable"):  # an edit of a copy would be lost: it raises instead
        stack[1]["attn"]["wq_a"] = jnp.zeros(1)
    back = layer_stack.unstack(stack)
    assert jax.tree.structure(back) == jax.tree.structure(unrolled.params["layers"])
    # a stacked leaf holds one segment member's layers on its leading axis
    assert stack.groups[2][1]["attn"]["wq_b"].shape[0] == 2
    assert unrolled.unrolled().params["layers"] is unrolled.params["layers"]
    assert layer_stack.is_stacked(Model(CFG, unrolled.params).params)


def test_forward_scanned_equals_unrolled(models):
    scanned, unrolled = models
    ids = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 40)), jnp.int32)
    a = jax.jit(forward_lib.forward_full, static_argnums=0)(CFG, scanned.params, ids)
    b = jax.jit(forward_lib.forward_full, static_argnums=0)(CFG, unrolled.params, ids)
    np.testing.assert_allclose(a.logits, b.logits, rtol=1e-5, atol=1e-5)
    assert len(a.hidden) == len(b.hidden) == CFG.num_layers
    for x, y in zip(a.hidden, b.hidden):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
    for x, y in zip(a.aux, b.aux):  # expert and indexer selections per layer, in layer order
        np.testing.assert_array_equal(x.routing.experts, y.routing.experts)
        if x.attention is not None:
            np.testing.assert_array_equal(x.attention, y.attention)


def test_generation_scanned_equals_unrolled(models):
    """Greedy tokens of the scanned model equal the unrolled model's, through `ds4jax.generate`'s engine (prefill in
    chunks, then decode calls), on a ragged batch. Speculative rounds on a scanned target are covered by
    tests/test_default_model.py (the suite scans the default model): greedy speculation equals plain greedy by
    construction, so running them here as well compared nothing more, for a third program's compile."""
    scanned, unrolled = models
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (37, 9, 70)]
    want = ds4jax.generate(unrolled, prompts, SamplingParams(max_new_tokens=12), prefill_chunk=16)
    assert ds4jax.generate(scanned, prompts, SamplingParams(max_new_tokens=12), prefill_chunk=16) == want


def _decode_jaxpr_size(cfg, scan: bool = True) -> int:
    spec = PoolSpec.for_role(cfg, role=Role.TARGET, max_slots=2, max_context=64, page_size=16, dtype="float32")
    layout = layer_stack.stacked_params if scan else (lambda cfg, p: p)
    params = jax.eval_shape(lambda: layout(cfg, params_lib.init(cfg, jax.random.key(0))))
    batch = steps.StepBatch(jax.ShapeDtypeStruct((2,), jnp.int32), jax.ShapeDtypeStruct((2, 1), jnp.int32),
                            jax.ShapeDtypeStruct((2,), jnp.int32))
    fn = lambda p, pool, b: steps.step(p, pool, b, None, cfg=cfg, spec=spec, role=Role.TARGET,
                                       logits=steps.Logits.LAST)
    jaxpr = jax.make_jaxpr(fn)(params, pools.abstract(spec), batch)

    def count(jx):
        return sum(1 + sum(count(s.jaxpr if hasattr(s, "jaxpr") else s) for s in jax.extend.core.jaxprs_in_params(e.params))
                   for e in jx.eqns)

    return count(jaxpr.jaxpr)


def test_traced_program_is_flat_in_depth():
    """Doubling the repeated segment leaves the decode step's traced program the same size up to the per-layer
    outputs sliced out of the scan (a few equations per layer), where unrolled it grows by whole layers."""
    deeper = CFG.replace(num_layers=CFG.num_layers + 4, attention_types=CFG.attention_types + (H, C) * 2,
                         mlp_types=CFG.mlp_types + (M.TOPK,) * 4)
    scanned = _decode_jaxpr_size(deeper) - _decode_jaxpr_size(CFG)
    unrolled = _decode_jaxpr_size(deeper, scan=False) - _decode_jaxpr_size(CFG, scan=False)
    assert 0 <= scanned <= 2 * 4, scanned  # 4 more layers: at most two bookkeeping equations each
    assert unrolled > 100 * 4, unrolled  # the same 4 layers unrolled: hundreds of equations each


def test_pooled_steps_scanned_equal_unrolled_on_poisoned_pools(models):
    """Prefill + decode through the step functions on NaN-poisoned pools: the scanned step reads only rows its
    layer wrote (a wrong per-kind pool index would read poison or another layer's rows) and leaves the same pool."""
    scanned, unrolled = models
    spec = PoolSpec.for_role(CFG, role=Role.TARGET, max_slots=2, max_context=64, page_size=16, dtype="float32")
    ids = np.random.default_rng(2).integers(0, CFG.vocab_size, (2, 24)).astype(np.int32)
    results = []
    for model in (scanned, unrolled):
        book, pool = pools.PoolBook(spec, CFG.vocab_size), pools.poisoned(spec)
        for s in (0, 1):
            book.admit(s)
            book.reserve(s, 32)
        pool = book.sync(pool)
        out, pool = steps.prefill(model.params, pool, steps.StepBatch(jnp.asarray([0, 1]), jnp.asarray(ids),
                                                                      jnp.asarray([24, 17])), cfg=CFG, spec=spec)
        book.commit([0, 1], [24, 17])
        nxt = jnp.argmax(out.logits, -1).astype(jnp.int32)[:, None]
        dec, pool = steps.decode(model.params, pool, steps.StepBatch(jnp.asarray([0, 1]), nxt, jnp.asarray([1, 1])),
                                 cfg=CFG, spec=spec)
        results.append((out, dec, jax.tree.map(np.asarray, pool)))
    (pa, da, poola), (pb, db, poolb) = results
    assert np.isfinite(np.asarray(pa.logits)).all() and np.isfinite(np.asarray(da.logits)).all()
    np.testing.assert_allclose(pa.logits, pb.logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(da.logits, db.logits, rtol=1e-5, atol=1e-5)
    for x, y in zip(pa.selections, pb.selections):
        np.testing.assert_array_equal(x, y)
    for name in pools.KVPool.__dataclass_fields__:
        np.testing.assert_allclose(getattr(poola, name), getattr(poolb, name), rtol=1e-5, atol=1e-5,
                                   equal_nan=True, err_msg=name)


def test_save_and_load_round_trip_stacked(models, tmp_path):
    scanned, unrolled = models
    ds4jax.save(scanned, tmp_path / "st")
    loaded = ds4jax.load(tmp_path / "st", dtype=jnp.float32)
    assert layer_stack.is_stacked(loaded.params)
    assert _same(loaded.params, scanned.params)


def test_snapshot_fingerprint_does_not_depend_on_the_layout(models):
    """A prefix snapshot names the weights, not how layers run: scanned and unrolled engines of one model agree,
    and changing one element of one stacked layer changes it."""
    from ds4jax.generation import snapshots

    scanned, unrolled = models
    spec = PoolSpec.for_role(CFG, role=Role.TARGET, max_slots=2, max_context=64, page_size=16)
    a, b = snapshots.fingerprint(scanned, spec, None), snapshots.fingerprint(unrolled, spec, None)
    assert a == b
    layers = layer_stack.unstack(scanned.params["layers"])
    layers[5]["attn"]["wq_a"] = layers[5]["attn"]["wq_a"].at[0, 0].add(1.0)
    changed = Model(CFG, {**scanned.params, "layers": layers})
    assert snapshots.fingerprint(changed, spec, None)["model"] != a["model"]
