"""A scanned layer's routed experts reach the grouped kernels in place (`ds4jax/model/layer_of.py`): the stack's
layer and expert axes merged, the selections' expert ids offset to the layer, no per-layer slice copied.

Under `lax.scan` a layer's weights are slices of the stacked arrays, and a custom call gets a slice as a copy of
its own: every decode step copied each scanned layer's whole expert set (`flash_slice(16)` in FP8 + FP4 decoded at
40 ms a step on an H100, session 16). Checked here: the scanned step through the Pallas kernels (interpreted) equals
the unrolled one, bf16-style arrays and FP4 experts alike (the GEMV at decode, the tile kernels at prefill); and
lowered for a GPU, the expert kernels' weight operands are the merged stacks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ds4jax.model import layer_of, params as params_lib
from ds4jax.model.config import AttentionType as A, MlpType as M, tiny
from ds4jax.model.handle import Model
from ds4jax.model.quantize import quantize_model
from ds4jax.runtime import kernels, pools, steps
from ds4jax.runtime.pool_spec import PoolSpec
from ds4jax.runtime.roles import Role

S, C, H = A.SLIDING, A.CSA, A.HCA
# a two-layer unit repeated twice after a single layer: the suite scans it (DS4JAX_SCAN_MIN_REPEATS=2)
CFG = tiny(num_layers=5, attention_types=(S,) + (H, C) * 2, mlp_types=(M.HASH,) + (M.TOPK,) * 4)
REPEATS = 2


@pytest.fixture(scope="module")
def models():
    params = params_lib.init(CFG, jax.random.key(7), jnp.float32)
    scanned, unrolled = Model(CFG, params), Model(CFG, params, scan_layers=False)
    assert any(seg.repeats == REPEATS for seg in scanned.params["layers"].segments)
    return {"arrays": (scanned, unrolled), "fp4": (quantize_model(scanned), quantize_model(unrolled))}


def _steps(model, spec, prefill: bool, impl=kernels.Impl.PALLAS_INTERPRET) -> list[np.ndarray]:
    """Logits of a prefill (if `prefill`) and a decode step of two requests, on NaN-poisoned pools."""
    ids = np.random.default_rng(4).integers(0, CFG.vocab_size, (2, 24)).astype(np.int32)
    book, pool = pools.PoolBook(spec, CFG.vocab_size), pools.poisoned(spec)
    for s in (0, 1):
        book.admit(s)
        book.reserve(s, 32)
    pool = book.sync(pool)
    run = dict(cfg=CFG, spec=spec, kernels=impl)
    out, nxt = [], ids[:, :1]
    if prefill:
        first, pool = steps.prefill(model.params, pool, steps.StepBatch(jnp.asarray([0, 1]), jnp.asarray(ids),
                                                                        jnp.asarray([24, 17])), **run)
        book.commit([0, 1], [24, 17])
        out.append(np.asarray(first.logits))
        nxt = jnp.argmax(first.logits, -1).astype(jnp.int32)[:, None]
    dec, _ = steps.decode(model.params, pool, steps.StepBatch(jnp.asarray([0, 1]), jnp.asarray(nxt),
                                                             jnp.asarray([1, 1])), **run)
    return out + [np.asarray(dec.logits)]


@pytest.fixture
def dense_in_place(monkeypatch):
    """Interpreted, scanned layers read every dense linear in place, however small (this model's are below the
    interpreter's threshold, `kernels.INTERPRET_IN_PLACE_MIN_BYTES`). Read at trace time, so the jitted steps'
    caches are cleared on both sides (a program traced at the other threshold would be reused)."""
    jax.clear_caches()
    monkeypatch.setattr(kernels, "INTERPRET_IN_PLACE_MIN_BYTES", 0)
    yield
    jax.clear_caches()


@pytest.mark.parametrize("weights", ["arrays", "fp4"])
def test_scanned_experts_in_place_equal_unrolled(models, weights, request):
    """Arrays: a decode step (the grouped matmul's tiles), the dense linears through the layer matmul. FP4: a
    prefill (48 selections: the FP4 tile kernel), then a decode step (4 selections: the GEMV)."""
    if weights == "arrays":
        request.getfixturevalue("dense_in_place")
    scanned, unrolled = models[weights]
    spec = PoolSpec.for_role(CFG, role=Role.TARGET, max_slots=2, max_context=64, page_size=16, dtype="float32")
    got, want = (_steps(m, spec, prefill=weights == "fp4") for m in (scanned, unrolled))
    for a, b in zip(got, want):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.device
def test_scanned_equals_unrolled_on_the_gpu(models):
    """The same through the compiled kernels on a GPU (marker `device`): the merged expert stacks, the FP8 matmul's
    layer index and the 64-bit offsets as the device runs them (FP8 dense + FP4 experts, a prefill of 48 selections
    and a decode step of 4)."""
    scanned, unrolled = models["fp4"]
    spec = PoolSpec.for_role(CFG, role=Role.TARGET, max_slots=2, max_context=64, page_size=16, dtype="float32")
    got, want = (_steps(m, spec, prefill=True, impl=kernels.Impl.PALLAS) for m in (scanned, unrolled))
    for a, b in zip(got, want):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def lowered(models):
    """weights -> the Triton kernels of that scanned model's decode step lowered for an H200, each lowered once
    for the tests below (the GPU policy reads every dense linear in place: no threshold to patch)."""
    done = {}

    def kernels_of(weights: str):
        if weights not in done:
            done[weights] = _lowered_decode_kernels(models[weights][0])
        return done[weights]

    return kernels_of


def _lowered_decode_kernels(model):
    """The Triton kernels of `model`'s decode step (two rows) lowered for an H200 on this host."""
    from ds4jax.rocm_check.extract import triton_kernels
    from ds4jax.rocm_check.lowering import as_if_on
    from ds4jax.rocm_check.targets import SM90

    spec = PoolSpec.for_role(CFG, role=Role.TARGET, max_slots=2, max_context=64, page_size=16, dtype="float32")
    batch = steps.StepBatch(*(jax.ShapeDtypeStruct(s, jnp.int32) for s in ((2,), (2, 1), (2,))))
    with as_if_on(SM90.target):
        lowered = jax.jit(lambda p, pool, b: steps.decode(p, pool, b, cfg=CFG, spec=spec, kernels="pallas")).trace(
            model.params, pools.abstract(spec), batch).lower(lowering_platforms=("cuda",))
    return triton_kernels(lowered)


def test_expert_kernels_take_the_merged_stacks(lowered):
    """The FP4 decode step lowered for an H200: the GEMV's packed weights are the stacks of the scanned layers,
    REPEATS x experts rows (no per-layer slice feeds a kernel), beside the single layers' own experts."""
    gemvs = [k for k in lowered("fp4") if k.name == "grouped_gemv_fp4"]
    leading = sorted({int(k.operands[3].split("x")[0]) for k in gemvs})  # operands: group, x even / odd, packed
    assert leading == [CFG.num_routed_experts, REPEATS * CFG.num_routed_experts], leading


def test_fp8_linears_take_the_stacks(lowered):
    """The same lowering: every FP8 dense linear of a scanned layer reads its weight in the stack ([REPEATS, in,
    out] values beside the layer index), none a per-layer slice; the single layers' linears take their 2-D weights."""
    matmuls = [k for k in lowered("fp4") if k.name == "fp8_matmul"]
    ranks = sorted({len(k.operands[1].split("x")) - 1 for k in matmuls})  # operands: x, values, scales[, layer]
    assert ranks == [2, 3], [k.operands for k in matmuls]
    stacked = [k for k in matmuls if len(k.operands[1].split("x")) == 4]
    assert all(int(k.operands[1].split("x")[0]) == REPEATS and len(k.operands) == 4 for k in stacked)


def test_dense_linears_take_the_stacks(models, lowered):
    """The same lowering with bf16-style weights: every dense linear of a scanned layer (attention's, wo_a's groups,
    the compressors', the indexer's, the router and the shared expert) reads its weight in the stack through the
    layer matmul ([REPEATS, in, out], or [REPEATS, groups, in, out] for wo_a, beside the layer index); in the
    published format (FP8 dense) what stays unquantized (wo_a, the router, ...). Before, XLA copied each slice
    out of its stack before the GEMM (docs/benchmarks/step_kernels_deviceless/). On a GPU however small they are
    (each slice's copy was a launch of its own)."""
    for weights in ("arrays", "fp4"):
        matmuls = [k for k in lowered(weights) if k.name == "layer_matmul"]
        stacks = [k.operands[2].split("x") for k in matmuls]  # operands: layer, x, stack
        assert {len(s) - 1 for s in stacks} == {3, 4}, [k.operands for k in matmuls]
        assert all(int(s[0]) == REPEATS for s in stacks), stacks
    # every dense linear's stack of the scanned unit has a kernel (the lowering lists each distinct kernel once)
    seg = next(i for i, g in enumerate(models["arrays"][0].params["layers"].segments) if g.repeats == REPEATS)
    leaves = jax.tree_util.tree_leaves_with_path(models["arrays"][0].params["layers"].groups[seg])
    want = {"x".join(map(str, w.shape)) for path, w in leaves
            if path[-1].key in layer_of.DENSE_LINEARS and "experts" not in str(path)}
    got = {k.operands[2].rsplit("x", 1)[0] for k in lowered("arrays") if k.name == "layer_matmul"}
    assert got == want, (got, want)


def test_mhc_kernels_take_the_stacks(models, lowered):
    """The same lowering: the mHC pre-step of a scanned layer reads its gate scales and biases and its sub-layer's
    norm weight in their stacks ([REPEATS, 3], [REPEATS, 2m + m*m], [REPEATS, e]) after the layer index; the single
    layer's call takes its own. As slices (before), each was an asynchronous copy of its own a call (12 of the 15
    launches a `flash_slice(12)` loop iteration spent slicing, docs/benchmarks/step_kernels_deviceless/)."""
    e, n = CFG.hidden_size, (2 + CFG.hc_mult) * CFG.hc_mult
    for weights in ("arrays", "fp4"):
        pre = {k.operands for k in lowered(weights) if k.name == "mhc_pre"}
        stacked = {ops for ops in pre if len(ops) == 6}
        assert stacked and all(ops[0] == "1xi32" and ops[3:] == (f"{REPEATS}x3xf32", f"{REPEATS}x{n}xf32",
                                                                 f"{REPEATS}x{e}xf32") for ops in stacked), pre
        assert all(ops[2:] == ("3xf32", f"{n}xf32", f"{e}xf32") for ops in pre - stacked), pre
        assert len(pre - stacked) == 1, pre  # the single sliding layer (its two calls lower to one kernel)


def test_a_mixed_mhc_call_is_refused():
    """`_mhc_kernel` takes its three small operands all stacked or all arrays: a half-stacked call (a dispatch
    bug) is an error, not a kernel reading one layer's scale with another's weight."""
    p = {"fn": jnp.ones((24, 4 * 64)), "scale": layer_of.LayerOf(jnp.ones((2, 3)), jnp.int32(0)),
         "base": jnp.ones((24,))}
    with pytest.raises(TypeError, match="all be stacks"):
        kernels.mhc_pre(jnp.ones((1, 4, 64)), p, jnp.ones((64,)), cfg=CFG, impl=kernels.Impl.PALLAS_INTERPRET)


def test_interpreted_small_dense_linears_stay_slices(models):
    """Interpreted (CPU), dense weights below 1 MiB a layer stay slices (the same math; each interpreted call is
    slow to compile): this model's decode step traces no layer matmul, and with the threshold at 0 it does."""
    assert kernels.INTERPRET_IN_PLACE_MIN_BYTES == 1 << 20
    spec = PoolSpec.for_role(CFG, role=Role.TARGET, max_slots=2, max_context=64, page_size=16, dtype="float32")
    batch = steps.StepBatch(*(jax.ShapeDtypeStruct(s, jnp.int32) for s in ((2,), (2, 1), (2,))))

    def names():
        jax.clear_caches()  # the jitted step would reuse a trace made at the other threshold
        jaxpr = jax.make_jaxpr(lambda p, pool, b: steps.decode(p, pool, b, cfg=CFG, spec=spec,
                                                               kernels="pallas_interpret"))(
            models["arrays"][0].params, pools.abstract(spec), batch)
        return str(jaxpr).count("layer_matmul")

    assert names() == 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "INTERPRET_IN_PLACE_MIN_BYTES", 0)
        assert names() > 0


def test_layer_linear_gives_way_to_xla_on_an_automatic_mesh_axis():
    """The dispatch: a stacked dense linear runs the layer matmul kernel, except where the call would be split over
    an automatic mesh axis (GSPMD cannot split a custom call), where it is XLA's dot on the layer's slice."""
    from ds4jax.model.layer_of import DenseLayerOf

    x, stack = jnp.ones((2, 64), jnp.float32), jnp.ones((3, 64, 32), jnp.float32)
    call = lambda x, s: kernels.layer_linear(  # noqa: E731
        x, DenseLayerOf(s, jnp.int32(1)), impl=kernels.Impl.PALLAS_INTERPRET)
    assert "pallas_call" in str(jax.make_jaxpr(call)(x, stack))
    mesh = jax.sharding.AbstractMesh((2,), ("tensor",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.sharding.use_abstract_mesh(mesh):
        jaxpr = str(jax.make_jaxpr(call)(x, stack))
    assert "pallas_call" not in jaxpr and "dynamic_slice" in jaxpr
