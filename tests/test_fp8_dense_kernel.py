"""The FP8 dense linears of a quantized model go through the FP8 matmul kernel when the steps run the Pallas
kernels (here interpreted), and dequantize next to the dot under the reference; both give the same logits; and the
quantized decode step with the compiled kernels lowers for cuda and rocm with one FP8 kernel call per FP8 linear.

The model is a tiny random one quantized as the published checkpoints are (`quantize_model(..., "fp4")`: FP8
dense linears with 128 x 128 blocks, FP4 experts), in OCP E4M3 and in FNUZ (MI300's format, doubled scales);
`tests/fp8_models.py` builds it and probes its steps.
"""

import re

import jax
import numpy as np
import pytest
from fp8_models import (CFG, FP8, assert_kernels_give_the_reference_logits, decode_step_text, fp8_converts,
                        pool_spec, quantized, step_eqns)

from ds4jax.model.quantized import Format, QuantizedWeight
from ds4jax.runtime.kernels import Impl

MAX_CONTEXT = 64


def _fp8_leaves(model):
    """The FP8 dense weights of the layers (each used once by a step)."""
    is_q = lambda x: isinstance(x, QuantizedWeight)
    return [w for w in jax.tree.leaves(model.params["layers"], is_leaf=is_q) if is_q(w) and w.format is Format.FP8]


@pytest.mark.parametrize("fmt", sorted(FP8))
def test_dispatch_runs_the_kernel_for_fp8_linears(fmt):
    """pallas_interpret: the step launches `fp8_matmul` and no FP8 value is converted outside a kernel (no
    dequantized weight); reference: no `fp8_matmul`, the FP8 weights are converted (dequantize + dot)."""
    model = quantized("fp4", fmt)
    fp8_leaves = _fp8_leaves(model)
    assert fp8_leaves and all(w.values.dtype == FP8[fmt] for w in fp8_leaves)
    for impl in (Impl.PALLAS_INTERPRET, Impl.REFERENCE):
        eqns = step_eqns(model, pool_spec(MAX_CONTEXT), impl)
        launches = [e for e, _ in eqns if e.primitive.name == "pallas_call" and e.params.get("name") == "fp8_matmul"]
        converts = fp8_converts(eqns, FP8[fmt])
        if impl is Impl.PALLAS_INTERPRET:
            assert len(launches) == len(fp8_leaves)  # one launch per FP8 linear (attention, shared experts, ...)
            assert converts == []
        else:
            assert launches == [] and converts


def test_quantized_model_logits_match_the_reference():
    model, spec = quantized("fp4", "ocp"), pool_spec(MAX_CONTEXT)
    ids = np.asarray(jax.random.randint(jax.random.key(1), (2, 24), 0, CFG.vocab_size))
    assert_kernels_give_the_reference_logits(model, spec, ids, chunk=12)


@pytest.mark.parametrize("platform,fmt", [("cuda", "ocp"), ("rocm", "fnuz")])
def test_quantized_decode_step_lowers_for_gpu(platform, fmt):
    """The decode step of the quantized model with the Pallas kernels lowers for a GPU (Pallas' Triton rules, the
    FP8 kernel inside the layer scan with stacked weights), one Triton call per FP8 linear among them."""
    model = quantized("fp4", fmt)
    text = decode_step_text(model, pool_spec(MAX_CONTEXT), platform)
    assert len(re.findall(r"call @fp8_matmul(?:_\d+)?\(", text)) == len(_fp8_leaves(model))
    assert "triton" in text
