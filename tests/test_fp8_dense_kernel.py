"""The FP8 dense linears of a quantized model go through the FP8 matmul kernel when the steps run the Pallas
kernels (here interpreted), and dequantize next to the dot under the reference; both give the same logits; and the
quantized decode step with the compiled kernels lowers for cuda and rocm with one FP8 kernel call per FP8 linear.

The model is a tiny random one quantized as the published checkpoints are (`quantize_model(..., "fp4")`: FP8
dense linears with 128 x 128 blocks, FP4 experts), in OCP E4M3 and in FNUZ (MI300's format, doubled scales).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params

import ds4jax
from ds4jax.model import params as P
from ds4jax.model.config import AttentionType, MlpType
from ds4jax.model.handle import Model
from ds4jax.model.quantize import quantize_model
from ds4jax.model.quantized import Format, QuantizedWeight
from ds4jax.runtime import pools, steps
from ds4jax.runtime.kernels import Impl
from ds4jax.runtime.pool_spec import PoolSpec

CFG = ds4jax.tiny(num_layers=3, attention_types=(AttentionType.SLIDING, AttentionType.CSA, AttentionType.HCA),
                  mlp_types=(MlpType.HASH, MlpType.TOPK, MlpType.TOPK))
FP8 = {"ocp": jnp.float8_e4m3fn, "fnuz": jnp.float8_e4m3fnuz}


@functools.cache
def quantized(fmt: str) -> Model:
    return quantize_model(Model(CFG, P.init(CFG, jax.random.key(0))), "fp4", fp8_dtype=FP8[fmt])


def _spec():
    return PoolSpec.for_role(CFG, role=ds4jax.Role.TARGET, max_slots=2, max_context=64, page_size=16,
                             dtype="float32")


def _eqns(jaxpr, inside_kernels=False):
    """(equation, inside a pallas_call) of a jaxpr and its sub-jaxprs."""
    for eqn in jaxpr.eqns:
        yield eqn, inside_kernels
        for sub in jaxprs_in_params(eqn.params):
            yield from _eqns(sub, inside_kernels or eqn.primitive.name == "pallas_call")


@pytest.mark.parametrize("fmt", sorted(FP8))
def test_dispatch_runs_the_kernel_for_fp8_linears(fmt):
    """pallas_interpret: the step launches `fp8_matmul` and no FP8 value is converted outside a kernel (no
    dequantized weight); reference: no `fp8_matmul`, the FP8 weights are converted (dequantize + dot)."""
    model = quantized(fmt)
    is_q = lambda x: isinstance(x, QuantizedWeight)
    fp8_leaves = [w for w in jax.tree.leaves(model.params["layers"], is_leaf=is_q)  # each used once by the step
                  if is_q(w) and w.format is Format.FP8]
    assert fp8_leaves and all(w.values.dtype == FP8[fmt] for w in fp8_leaves)
    spec = _spec()
    batch = steps.StepBatch(jnp.zeros((2,), jnp.int32), jnp.zeros((2, 1), jnp.int32), jnp.ones((2,), jnp.int32))
    for impl in (Impl.PALLAS_INTERPRET, Impl.REFERENCE):
        step = functools.partial(steps._step, cfg=CFG, spec=spec, role=ds4jax.Role.TARGET, logits=steps.Logits.LAST,
                                 kernels=impl)
        closed = jax.make_jaxpr(lambda p, pool, b, step=step: step(p, pool, b, None))(
            model.params, pools.zeros(spec), batch)
        eqns = list(_eqns(closed.jaxpr))
        launches = [e for e, _ in eqns if e.primitive.name == "pallas_call" and e.params.get("name") == "fp8_matmul"]
        fp8_converts = [e for e, inside in eqns if not inside and e.primitive.name == "convert_element_type"
                        and e.invars[0].aval.dtype == FP8[fmt]]
        if impl is Impl.PALLAS_INTERPRET:
            assert len(launches) == len(fp8_leaves)  # one launch per FP8 linear (attention, shared experts, ...)
            assert fp8_converts == []
        else:
            assert launches == [] and fp8_converts


def _logits(model: Model, impl: Impl, ids: np.ndarray, chunk: int) -> np.ndarray:
    """Prefill two rows in chunks of `chunk` tokens (m = 2 * chunk rows in the linears), then one decode step
    (m = 2); every logit."""
    spec = _spec()
    book = pools.PoolBook(spec, CFG.vocab_size)
    slots = [book.admit(1), book.admit(0)]
    total = ids.shape[1] + 1
    for s in slots:
        book.reserve(s, total)
    pool = book.sync(pools.poisoned(spec))
    out = []
    for start in range(0, ids.shape[1], chunk):
        tok = ids[:, start:start + chunk]
        n = [tok.shape[1]] * 2
        book.check_extend(slots, tok, n)
        batch = steps.StepBatch(jnp.asarray(slots, jnp.int32), jnp.asarray(tok), jnp.asarray(n, jnp.int32))
        o, pool = steps.prefill(model.params, pool, batch, cfg=CFG, spec=spec, all_logits=True, kernels=impl)
        book.commit(slots, n)
        out.append(np.asarray(o.logits))
    batch = steps.StepBatch(jnp.asarray(slots, jnp.int32), jnp.asarray(ids[:, -1:]), jnp.ones((2,), jnp.int32))
    o, _ = steps.decode(model.params, pool, batch, cfg=CFG, spec=spec, kernels=impl)
    return np.concatenate(out + [np.asarray(o.logits)[:, None]], axis=1)


def test_quantized_model_logits_match_the_reference():
    model = quantized("ocp")
    ids = np.asarray(jax.random.randint(jax.random.key(1), (2, 24), 0, CFG.vocab_size))
    ref = _logits(model, Impl.REFERENCE, ids, chunk=12)
    got = _logits(model, Impl.PALLAS_INTERPRET, ids, chunk=12)
    assert np.isfinite(ref).all()
    # the same products in f32; sums reassociated (k splits, tiles) and the other kernels' own tolerance
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("platform,fmt", [("cuda", "ocp"), ("rocm", "fnuz")])
def test_quantized_decode_step_lowers_for_gpu(platform, fmt):
    """The decode step of the quantized model with the Pallas kernels lowers for a GPU (Pallas' Triton rules, the
    FP8 kernel inside the layer scan with stacked weights), one Triton call per FP8 linear among them."""
    model = quantized(fmt)
    spec = _spec()
    s = jax.ShapeDtypeStruct
    batch = steps.StepBatch(s((2,), jnp.int32), s((2, 1), jnp.int32), s((2,), jnp.int32))
    step = functools.partial(steps._step, streams_in=None, cfg=CFG, spec=spec, role=ds4jax.Role.TARGET,
                             logits=steps.Logits.LAST, kernels=Impl.PALLAS)
    text = jax.jit(step).trace(model.params, pools.abstract(spec), batch).lower(
        lowering_platforms=(platform,)).as_text()
    is_q = lambda x: isinstance(x, QuantizedWeight)
    n_fp8 = sum(is_q(w) and w.format is Format.FP8 for w in jax.tree.leaves(model.params["layers"], is_leaf=is_q))
    assert len(re.findall(r"call @fp8_matmul(?:_\d+)?\(", text)) == n_fp8
    assert "triton" in text
