"""scripts/spec_anatomy.py's kernel groups: the op scopes the model records (`layer_stack.LayerAt.name`, under the
step's ``target`` / ``draft`` scopes when unrolled, alone inside a scan body) map to one group per layer or
scanned body, and draft ops to ``draft``."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import spec_anatomy  # noqa: E402
from ds4jax.model.config import AttentionType, MlpType  # noqa: E402
from ds4jax.model.layer_stack import LayerAt  # noqa: E402


def _name(attention: AttentionType, first: int, unit: int = 0) -> str:
    return LayerAt(attention, MlpType.TOPK, first=first, unit=((attention, MlpType.TOPK),) * unit).name


def test_groups_name_unrolled_layers_and_scanned_bodies():
    csa, hca = _name(AttentionType.CSA, 1), _name(AttentionType.HCA, 2, unit=2)
    assert (csa, hca) == ("layer1_csa", "layer2+2j_hca")  # the names the scopes carry
    assert spec_anatomy.group_of(f"jit(decode_loop)/while/body/target/{csa}/compressor/dot_general") == f"target/{csa}"
    assert spec_anatomy.group_of(f"{hca}/indexer/reduce_max") == f"target/{hca}"  # a scan body's op
    assert spec_anatomy.group_of("jit(speculative_loop)/while/body/draft/mtp/layer0_sliding/dot") == "draft"
    assert spec_anatomy.group_of("jit(decode_loop)/while/body/argmax") == "other"
    # a step's ops outside its layers: the draft's under its step's scope, the target's in a group of their own
    assert spec_anatomy.group_of("jit(speculative_loop)/while/body/draft_step/dot_general") == "draft"
    assert spec_anatomy.group_of("jit(decode_loop)/while/body/target_step/dot_general") == \
        "target/head, embedding, geometry"


_BODY = "jit(speculative_loop)/while/body/"
HLO = "\n".join([
    "HloModule jit_speculative_loop, entry_computation_layout={()->f32[]}", "",
    "%body.1 (p: f32[]) -> f32[] {",
    "  %p = f32[] parameter(0)",
    "  %loop_fusion.3 = f32[] fusion(f32[] %p), kind=kLoop, calls=%fc.3, "
    f'metadata={{op_name="{_BODY}draft/mtp/layer0_sliding/add"}}',
    "  %input_reduce_fusion.12 = f32[] fusion(f32[] %p), kind=kInput, calls=%fc.12, "
    f'metadata={{op_name="{_BODY}layer1+2j_csa/attention/reduce_sum"}}',
    '  ROOT %custom-call.7 = f32[] custom-call(f32[] %loop_fusion.3), custom_call_target="__gpu$xla.gpu.triton", '
    f'backend_config={{"name":"grouped_matmul","ir":"xyz"}}, metadata={{op_name="{_BODY}layer2_hca/grouped_matmul"}}',
    "}", ""])


def test_kernels_without_a_scope_take_it_from_the_optimized_hlo(tmp_path):
    """A trace that names kernels but records no scope (an H100, jax 0.11.2): the optimized HLO's op_name of the
    instruction the kernel is named after decides its group (XLA kernels: the instruction name with dots as
    underscores; Pallas kernels: their call's name, a repeat's ``__<n>`` suffix dropped)."""
    import device_trace

    (tmp_path / "module_0007.jit_speculative_loop.sm_9.0_gpu_after_optimizations.txt").write_text(HLO)
    (tmp_path / "module_0003.jit_decode_loop.sm_9.0_gpu_after_optimizations.txt").write_text(
        HLO.replace("layer1+2j_csa", "layer5_hca"))
    scopes = device_trace.hlo_scopes(tmp_path, "speculative_loop")
    events = [("loop_fusion_3", 0, 10, ""), ("input_reduce_fusion_12", 10, 30, ""), ("grouped_matmul__1", 30, 60, ""),
              ("sm90_xmma_gemm", 60, 70, ""), ("loop_fusion_3", 70, 80, " layer4_sliding/x"),  # its own scope wins
              # a library kernel whose event names its instruction (an `hlo_op` stat) but no layer
              ("sm90_xmma_gemm", 80, 90, " input_reduce_fusion.12 jit(speculative_loop)")]
    summary = spec_anatomy.summary(events, units=1, wall=1.0, scopes=scopes)
    assert {g: v["kernels"] for g, v in summary["groups"].items()} == {"draft": 1, "target/layer1+2j_csa": 2,
                                                                       "target/layer2_hca": 1, "other": 1,
                                                                       "target/layer4_sliding": 1}
    assert summary["other_kernels"] == {"sm90_xmma_gemm |": [1, 0.01]}  # what stayed unnamed, to name next
    assert device_trace.hlo_scopes(tmp_path, "nothing_here") == {}


def test_a_round_s_own_work_has_groups_of_its_own():
    from ds4jax.generation import spec_rounds

    assert set(spec_anatomy.ROUND_GROUPS) == {spec_rounds.PROPOSE_SCOPE, spec_rounds.ACCEPT_SCOPE}
    propose, accept = (spec_anatomy.ROUND_GROUPS[s] for s in (spec_rounds.PROPOSE_SCOPE, spec_rounds.ACCEPT_SCOPE))
    assert spec_anatomy.group_of(f"{_BODY}round_propose/argmax") == propose
    assert spec_anatomy.group_of(f"{_BODY}round_accept/jit(_where)/select_n") == accept
    # the draft steps inside either phase stay the draft's, the verify's head the target's
    assert spec_anatomy.group_of(f"{_BODY}round_propose/draft_step/draft/mtp/layer0_sliding/dot") == "draft"
    assert spec_anatomy.group_of(f"{_BODY}round_accept/draft_step/dot_general") == "draft"
    assert spec_anatomy.group_of(f"{_BODY}target_step/dot_general") == "target/head, embedding, geometry"
    events = [("argmax_fusion", 0, 10, f" {_BODY}round_propose/argmax"),
              ("sort_1", 10, 40, f" {_BODY}round_accept/sort"), ("loop_and_fusion", 40, 41, f" {_BODY}and")]
    summary = spec_anatomy.summary(events, units=1, wall=1.0)
    assert {g: v["kernels"] for g, v in summary["groups"].items()} == {propose: 1, accept: 1, "other": 1}
    assert len(summary["other_kernels"]) == 3  # each listed by name: none is a step's


def _name_stacks(jaxpr, out: set) -> set:
    """The op scopes of every equation of a jaxpr and of the jaxprs nested in it (loop bodies, branches)."""
    import jax.extend

    for eqn in jaxpr.eqns:
        out.add(str(eqn.source_info.name_stack))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            _name_stacks(sub.jaxpr if hasattr(sub, "jaxpr") else sub, out)
    return out


def test_the_speculative_loop_puts_its_phases_under_their_scopes():
    """The dispatch itself: the traced speculative program's own work (argmax, acceptance) carries the two scopes,
    and its draft steps keep theirs inside them, so a profile's groups follow the code."""
    import functools

    import jax
    import jax.numpy as jnp

    import abstract_inputs
    import ds4jax
    from ds4jax.generation import spec_rounds
    from ds4jax.model import params as model_params
    from ds4jax.runtime import pools, steps
    from ds4jax.runtime.pool_spec import PoolSpec
    from ds4jax.runtime.roles import Role

    cfg = ds4jax.tiny(num_layers=1, attention_types=(ds4jax.AttentionType.SLIDING,), mlp_types=(ds4jax.MlpType.HASH,))
    common = dict(max_slots=2, max_context=64, draft_tokens=3, dtype="float32")
    tspec, dspec = (PoolSpec.for_role(cfg, role=r, **common) for r in (Role.TARGET, Role.DRAFT))
    fn = functools.partial(spec_rounds.speculative_loop.uncached, cfg=cfg, tspec=tspec, dspec=dspec, k=2, max_rounds=2,
                           kernels=steps.Impl.REFERENCE)
    jaxpr = jax.make_jaxpr(fn)(model_params.abstract(cfg, jnp.float32), pools.abstract(tspec), pools.abstract(dspec),
                               abstract_inputs.slot_state(cfg, 2, jnp.float32), abstract_inputs.rows(2)).jaxpr
    groups = {spec_anatomy.group_of(s) for s in _name_stacks(jaxpr, set())}
    assert set(spec_anatomy.ROUND_GROUPS.values()) <= groups, groups
    assert {"draft", "target/head, embedding, geometry"} <= groups, groups
    stacks = _name_stacks(jaxpr, set())
    assert any("round_propose" in s and "draft_step" in s for s in stacks)  # the chain's draft steps
    assert any("round_accept" in s and "draft_step" in s for s in stacks)  # the draft extend
