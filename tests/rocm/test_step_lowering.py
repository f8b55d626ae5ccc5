"""The whole serving path lowers for ROCm with no CUDA-only custom call: prefill, decode, verify and draft extend
of a Flash-shaped model (one layer of each attention kind), the engine's programs (prefill chunk, multi-step decode loop, snapshot
restore, speculative rounds: draft chain, verification, sampling, acceptance) and token sampling,
traced as if on an MI300 (`as_if_on`: Pallas kernels, GPU MoE strategies) and lowered for platform "rocm"."""

from __future__ import annotations

import functools
import re
from unittest import mock

import abstract_inputs
import jax
import jax.numpy as jnp
import pytest

from ds4jax.generation import loops, sampling, spec_rounds
from ds4jax.model import params as model_params
from ds4jax.model.layers import moe
from ds4jax.rocm_check.extract import TRITON_TARGET, custom_call_targets
from ds4jax.rocm_check.lowering import MODELS, as_if_on
from ds4jax.rocm_check.targets import GFX942
from ds4jax.runtime import pools, steps
from ds4jax.runtime.pool_spec import PoolSpec
from ds4jax.runtime.roles import Role

# Custom calls that only the CUDA runtime implements (cuBLAS / cuBLASLt, cuDNN, cuSOLVER, cuSPARSE, jaxlib's cu_*
# kernels, Mosaic GPU). An XLA GEMM or fusion is not a custom call; ROCm's would be hipblas*/miopen*/hip_*.
CUDA_ONLY = re.compile(r"cublas|cudnn|cusolver|cusparse|^cu_|mosaic_gpu|__gpu\$xla\.gpu\.ext", re.IGNORECASE)
# Everything a ROCm lowering of these programs may contain today; anything new needs a look (and a line here).
ROCM_OK = {TRITON_TARGET}

CFG = MODELS["Flash"]()  # real Flash per-layer dims: a sliding, a CSA and an HCA layer; the MTP block drafts
K = 2  # draft tokens
S = jax.ShapeDtypeStruct
I32 = jnp.int32


def _specs():
    common = dict(max_slots=4, max_context=4096, draft_tokens=K + 1, dtype="bfloat16")
    return (PoolSpec.for_role(CFG, role=Role.TARGET, **common), PoolSpec.for_role(CFG, role=Role.DRAFT, **common))


def _batch(rows, tokens):
    return steps.StepBatch(S((rows,), I32), S((rows, tokens), I32), S((rows,), I32))


def _lower(fn, *args):
    """Trace as if on gfx942, record the MoE strategies chosen, lower for "rocm"; -> (custom call targets, moe)."""
    chosen = []

    def spy(*a, **kw):
        chosen.append(real(*a, **kw))
        return chosen[-1]

    real = moe.moe_strategy
    with as_if_on(GFX942.target), mock.patch.object(moe, "moe_strategy", spy):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("rocm",))
    return custom_call_targets(lowered), set(chosen)


def _assert_rocm_clean(targets):
    bad = sorted({t for t in targets if CUDA_ONLY.search(t)})
    assert not bad, f"CUDA-only custom calls in a ROCm lowering: {bad}"
    unknown = sorted(set(targets) - ROCM_OK)
    assert not unknown, f"custom calls not known to have a ROCm implementation: {unknown}"


@functools.cache
def _lowered_steps():
    tspec, dspec = _specs()
    params = model_params.abstract(CFG, jnp.bfloat16)
    tpool, dpool = pools.abstract(tspec), pools.abstract(dspec)
    streams = lambda t: S((4, t, CFG.hc_mult, CFG.hidden_size), jnp.float32)  # noqa: E731
    return {
        "prefill": _lower(functools.partial(steps.prefill, cfg=CFG, spec=tspec), params, tpool, _batch(1, 512)),
        "decode": _lower(functools.partial(steps.decode, cfg=CFG, spec=tspec), params, tpool, _batch(4, 1)),
        "verify": _lower(functools.partial(steps.verify, cfg=CFG, spec=tspec), params, tpool, _batch(4, K + 1)),
        "draft_extend": _lower(functools.partial(steps.draft_extend, cfg=CFG, spec=dspec), params, dpool,
                               _batch(4, K + 1), streams(K + 1)),
    }


@pytest.mark.parametrize("step", ["prefill", "decode", "verify", "draft_extend"])
def test_step_lowers_for_rocm(step):
    targets, strategies = _lowered_steps()[step]
    _assert_rocm_clean(targets)
    # the Pallas kernels are in (sparse attention in every layer; the indexer's two kernels in the target's CSA layer)
    want = 1 if step == "draft_extend" else 3 + 2  # 3 distinct sparse-attention calls (sliding, CSA, HCA) + indexer
    want += 2  # routed experts: the grouped-matmul kernel (gate/up and down) replaces the jnp MoE strategies
    assert targets.count(TRITON_TARGET) >= want, targets  # (kernels added later only add calls)
    assert "ragged" not in strategies, strategies  # XLA on GPU lowers ragged_dot densely


def test_speculative_loop_lowers_for_rocm():
    """Draft chain, verification, rejection sampling and the draft extend: the engine's rounds in one program."""
    tspec, dspec = _specs()
    rows, state = abstract_inputs.rows(4), abstract_inputs.slot_state(CFG, tspec.max_slots, jnp.bfloat16)
    fn = functools.partial(spec_rounds.speculative_loop.uncached, cfg=CFG, tspec=tspec, dspec=dspec, k=K,
                           kernels=steps.Impl.PALLAS, max_rounds=4)
    targets, _ = _lower(fn, model_params.abstract(CFG, jnp.bfloat16), pools.abstract(tspec), pools.abstract(dspec),
                        state, rows)
    _assert_rocm_clean(targets)
    assert TRITON_TARGET in targets


@pytest.mark.parametrize("program", ["prefill_call", "decode_loop", "restore_call"])
def test_engine_programs_lower_for_rocm(program):
    """The engine's own compiled programs for plain serving: a prefill chunk with first-token sampling and the
    draft extend, the multi-step decode loop, and a snapshot restore's draft step."""
    tspec, dspec = _specs()
    params, tpool, dpool = model_params.abstract(CFG, jnp.bfloat16), pools.abstract(tspec), pools.abstract(dspec)
    kw = dict(cfg=CFG, kernels=steps.Impl.PALLAS)
    if program == "prefill_call":
        b, c = 1, 512
        fn = functools.partial(loops.prefill_call.uncached, tspec=tspec, dspec=dspec, **kw)
        state = abstract_inputs.slot_state(CFG, tspec.max_slots, jnp.bfloat16)
        args = (params, tpool, dpool, state, abstract_inputs.rows(b), S((b, c), I32), S((b,), I32),
                S((b, c), I32), S((b,), jnp.bool_))
    elif program == "decode_loop":
        fn = functools.partial(loops.decode_loop.uncached, spec=tspec, max_steps=4, **kw)
        args = (params, tpool, abstract_inputs.rows(4))
    else:
        fn = functools.partial(loops.restore_call.uncached, dspec=dspec, **kw)
        args = (params, dpool, abstract_inputs.slot_state(CFG, tspec.max_slots, jnp.bfloat16), abstract_inputs.rows(4),
                S((4,), jnp.bool_), S((4,), I32))
    targets, strategies = _lower(fn, *args)
    _assert_rocm_clean(targets)
    assert TRITON_TARGET in targets
    assert "ragged" not in strategies, strategies


def test_sampling_lowers_for_rocm():
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), 4))
    targets, _ = _lower(sampling.sample, S((4, CFG.vocab_size), jnp.float32), keys, S((4,), jnp.float32),
                        S((4,), jnp.float32))
    _assert_rocm_clean(targets)


def test_the_check_catches_a_cuda_only_call():
    with pytest.raises(AssertionError, match="CUDA-only"):
        _assert_rocm_clean([TRITON_TARGET, "__cublas$lt$matmul"])
    with pytest.raises(AssertionError, match="not known"):
        _assert_rocm_clean(["some_new_call"])
