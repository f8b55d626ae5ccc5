"""A base checkpoint's FP8 routed experts go through the FP8 grouped-matmul kernel when the steps run the Pallas
kernels (here interpreted): the step launches `grouped_matmul_fp8` and converts no FP8 value outside a kernel (the
expert stack is never dequantized whole); under the reference they dequantize next to their matmul; both give the
same logits (decode tiles and, with a long chunk, 64-row prefill tiles); the decode step lowers for cuda and rocm.

The model is a tiny random one quantized as a base (``"fp8"``) checkpoint is: FP8 dense linears and FP8 experts
with 128 x 128 blocks (`quantize_model(..., "fp8")`), in OCP E4M3 and in FNUZ (MI300's format, doubled scales);
`tests/fp8_models.py` builds it and probes its steps.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fp8_models import (CFG, FP8, assert_kernels_give_the_reference_logits, decode_step_text, fp8_converts,
                        pool_spec, quantized, step_eqns)

from ds4jax.model.layers import moe
from ds4jax.model.quantized import Format, QuantizedWeight
from ds4jax.runtime import routed_experts
from ds4jax.runtime.kernels import Impl

MAX_CONTEXT = 160
is_q = lambda x: isinstance(x, QuantizedWeight)


def test_fp8_quantize_makes_fp8_experts():
    for name, w in quantized("fp8", "ocp").params["layers"][1]["ffn"]["experts"].items():
        assert is_q(w) and w.format is Format.FP8 and w.values.dtype == jnp.float8_e4m3fn, name
        assert w.values.shape[0] == CFG.num_routed_experts and w.block == (128, 128)


@pytest.mark.parametrize("fmt", sorted(FP8))
def test_dispatch_runs_the_fp8_grouped_kernel(fmt):
    """pallas_interpret: the decode step launches `grouped_matmul_fp8` (gate + up, then down, per MoE layer body)
    and neither the bf16 grouped matmul nor any FP8 -> float conversion outside a kernel (so no expert stack is
    dequantized); reference: no FP8 grouped kernel, the FP8 experts are converted (dequantize + dot)."""
    model = quantized("fp8", fmt)
    for impl in (Impl.PALLAS_INTERPRET, Impl.REFERENCE):
        eqns = step_eqns(model, pool_spec(MAX_CONTEXT), impl)
        names = [e.params.get("name") for e, _ in eqns if e.primitive.name == "pallas_call"]
        converts = fp8_converts(eqns, FP8[fmt])
        if impl is Impl.PALLAS_INTERPRET:
            assert names.count("grouped_matmul_fp8") >= 2 and "grouped_matmul" not in names, names
            assert converts == []
        else:
            assert "grouped_matmul_fp8" not in names and converts


def test_fp8_experts_call_the_kernel(monkeypatch):
    """The dispatch hands the FP8 experts' values and scales to the kernel as stored (not a dequantized copy)."""
    seen = []
    real = routed_experts.pallas_kernels.grouped_matmul_fp8
    monkeypatch.setattr(routed_experts.pallas_kernels, "grouped_matmul_fp8",
                        lambda x, ws, tg, **kw: seen.append([v.dtype for v, _ in ws]) or real(x, ws, tg, **kw))
    experts = quantized("fp8", "ocp").params["layers"][1]["ffn"]["experts"]
    experts = jax.tree.map(lambda a: a[0] if a.ndim > 3 else a, experts)  # a stacked layer group: its first layer
    x = jax.random.normal(jax.random.key(2), (3, CFG.hidden_size), jnp.float32)
    ids = jnp.asarray([[0, 5], [5, 7], [1, 0]], jnp.int32)
    routing = routed_experts.Routing(ids, jnp.full(ids.shape, 0.5, jnp.float32))
    got = routed_experts.routed_experts_grouped(x, routing, experts, CFG, interpret=True)
    want = moe.routed_experts(x, routing, experts, CFG)
    assert seen == [[jnp.float8_e4m3fn] * 2, [jnp.float8_e4m3fn]]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_fp8_expert_model_logits_match_the_reference():
    """A 72-token chunk of 2 rows is 288 selections (> 256: 64-row prefill tiles), then the decode step runs decode
    tiles (one prefill chunk: a second, shorter one would compile two more programs for tiles the decode step
    covers). OCP only (each impl compiles its steps); the kernel tests check FNUZ against the reference."""
    model = quantized("fp8", "ocp")
    ids = np.asarray(jax.random.randint(jax.random.key(1), (2, 72), 0, CFG.vocab_size))
    assert 2 * 72 * CFG.num_experts_per_tok > routed_experts.PREFILL_ABOVE
    spec = pool_spec(MAX_CONTEXT)
    assert_kernels_give_the_reference_logits(model, spec, ids, chunk=72)


@pytest.mark.parametrize("platform,fmt", [("cuda", "ocp"), ("rocm", "fnuz")])
def test_fp8_expert_decode_step_lowers_for_gpu(platform, fmt):
    """The decode step with the compiled kernels lowers for a GPU with the FP8 grouped kernel among its Triton
    calls (Pallas' Triton rules, inside the layer scan with stacked FP8 experts)."""
    text = decode_step_text(quantized("fp8", fmt), pool_spec(MAX_CONTEXT), platform)
    assert len(re.findall(r"call @grouped_matmul_fp8(?:_\d+)?\(", text)) >= 2
    assert not re.findall(r"call @grouped_matmul(?:_\d+)?\(", text)  # no bf16 grouped matmul on dequantized experts
