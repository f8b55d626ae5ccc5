"""Tiny random models quantized as the published checkpoints are, and the step probes the FP8 kernel tests share
(tests/test_fp8_dense_kernel.py: FP8 dense linears; tests/test_fp8_experts_kernel.py: FP8 routed experts).

`quantized(experts, fmt)`: `quantize_model(..., experts)` of one random model, ``"fp4"`` (an instruct checkpoint:
FP8 dense linears, FP4 experts) or ``"fp8"`` (a base one: FP8 experts too), with FP8 values in OCP E4M3 or FNUZ
(MI300's format, doubled scales). The probes: a decode step's equations (`step_eqns`) with the FP8 conversions
outside kernels (`fp8_converts`), its text lowered for a GPU (`decode_step_text`), and every logit of a chunked
prefill plus one decode step (`step_logits`) on NaN-poisoned pools.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import jaxprs_in_params

import ds4jax
from ds4jax.model import params as P
from ds4jax.model.config import AttentionType, MlpType
from ds4jax.model.handle import Model
from ds4jax.model.quantize import quantize_model
from ds4jax.runtime import pools, steps
from ds4jax.runtime.kernels import Impl
from ds4jax.runtime.pool_spec import PoolSpec

CFG = ds4jax.tiny(num_layers=3, attention_types=(AttentionType.SLIDING, AttentionType.CSA, AttentionType.HCA),
                  mlp_types=(MlpType.HASH, MlpType.TOPK, MlpType.TOPK))
FP8 = {"ocp": jnp.float8_e4m3fn, "fnuz": jnp.float8_e4m3fnuz}


@functools.cache
def quantized(experts: str, fmt: str) -> Model:
    return quantize_model(Model(CFG, P.init(CFG, jax.random.key(0))), experts, fp8_dtype=FP8[fmt])


def pool_spec(max_context: int) -> PoolSpec:
    return PoolSpec.for_role(CFG, role=ds4jax.Role.TARGET, max_slots=2, max_context=max_context, page_size=16,
                             dtype="float32")


def _eqns(jaxpr, inside_kernels=False):
    """(equation, inside a pallas_call) of a jaxpr and its sub-jaxprs."""
    for eqn in jaxpr.eqns:
        yield eqn, inside_kernels
        for sub in jaxprs_in_params(eqn.params):
            yield from _eqns(sub, inside_kernels or eqn.primitive.name == "pallas_call")


def step_eqns(model: Model, spec: PoolSpec, impl: Impl) -> list:
    """(equation, inside a pallas_call) of a 2-row decode step's jaxpr under `impl`."""
    batch = steps.StepBatch(jnp.zeros((2,), jnp.int32), jnp.zeros((2, 1), jnp.int32), jnp.ones((2,), jnp.int32))
    step = functools.partial(steps._step, cfg=CFG, spec=spec, role=ds4jax.Role.TARGET, logits=steps.Logits.LAST,
                             kernels=impl)
    closed = jax.make_jaxpr(lambda p, pool, b: step(p, pool, b, None))(model.params, pools.zeros(spec), batch)
    return list(_eqns(closed.jaxpr))


def fp8_converts(eqns: list, dtype) -> list:
    """The conversions of FP8 (`dtype`) values outside any kernel: a dequantized weight."""
    return [e for e, inside in eqns if not inside and e.primitive.name == "convert_element_type"
            and e.invars[0].aval.dtype == dtype]


def decode_step_text(model: Model, spec: PoolSpec, platform: str) -> str:
    """The 2-row decode step with the compiled Pallas kernels, lowered for `platform` (cuda / rocm) on this host."""
    s = jax.ShapeDtypeStruct
    batch = steps.StepBatch(s((2,), jnp.int32), s((2, 1), jnp.int32), s((2,), jnp.int32))
    step = functools.partial(steps._step, streams_in=None, cfg=CFG, spec=spec, role=ds4jax.Role.TARGET,
                             logits=steps.Logits.LAST, kernels=Impl.PALLAS)
    return jax.jit(step).trace(model.params, pools.abstract(spec), batch).lower(
        lowering_platforms=(platform,)).as_text()


def step_logits(model: Model, spec: PoolSpec, impl: Impl, ids: np.ndarray, chunk: int) -> np.ndarray:
    """Prefill two rows in chunks of `chunk` tokens (m = 2 * chunk rows in the linears), then one decode step
    (m = 2); every logit."""
    book = pools.PoolBook(spec, CFG.vocab_size)
    slots = [book.admit(1), book.admit(0)]
    for s in slots:
        book.reserve(s, ids.shape[1] + 1)
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


def assert_kernels_give_the_reference_logits(model: Model, spec: PoolSpec, ids: np.ndarray, chunk: int) -> None:
    """`step_logits` under the interpreted Pallas kernels equals the reference kernels': the same products in f32,
    sums reassociated (k splits, tiles) and the other kernels' own tolerance."""
    ref = step_logits(model, spec, Impl.REFERENCE, ids, chunk=chunk)
    got = step_logits(model, spec, Impl.PALLAS_INTERPRET, ids, chunk=chunk)
    assert np.isfinite(ref).all()
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
