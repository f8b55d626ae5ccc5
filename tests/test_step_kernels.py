"""scripts/step_kernels.py reads an optimized HLO module's launches: the entry's and its loops' (times the known trip
count), not fusion bodies or free ops, each under its layer scope and the innermost ds4jax frame of its stack."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import step_kernels  # noqa: E402

HLO = '''HloModule jit_step, is_scheduled=true

FileNames
1 "/x/site-packages/jax/_src/numpy.py"
2 "/work/ds4jax/model/layers/linear.py"

FunctionNames
1 "einsum"
2 "_one_row"

FileLocations
1 {file_name_id=1 function_name_id=1 line=10 end_line=10 column=1 end_column=2}
2 {file_name_id=2 function_name_id=2 line=53 end_line=53 column=1 end_column=2}

StackFrames
1 {file_location_id=2 parent_frame_id=0}
2 {file_location_id=1 parent_frame_id=1}

%fused_computation (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  ROOT %m = f32[4]{0} multiply(%p0, %p0)
}

%loop_body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[4]{0} get-tuple-element(%t), index=1
  %f1 = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_computation, metadata={op_name="jit(step)/while/body/layer1+2j_csa/mul" stack_frame_id=2}
  %f2 = f32[4]{0} fusion(%f1), kind=kInput, calls=%fused_computation, metadata={op_name="jit(step)/while/body/layer1+2j_csa/add"}
  ROOT %r = (s32[], f32[4]{0}) tuple(%i, %f2)
}

%loop_cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %c = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

ENTRY %main (a: f32[4], /*index=1*/b: s32[]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %b = s32[] parameter(1)
  %e = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_computation, metadata={op_name="jit(step)/target/embed/mul"}
  %tup = (s32[], f32[4]{0}) tuple(%b, %e)
  %w = (s32[], f32[4]{0}) while(%tup), condition=%loop_cond, body=%loop_body, backend_config={"known_trip_count":{"n":"3"}}
  %k = f32[4]{0} custom-call(%e), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/target/layer0_sliding/sinkhorn"}
  ROOT %out = f32[4]{0} get-tuple-element(%w), index=1
}
'''  # noqa: E501 (HLO lines as XLA prints them)


def test_launches_count_loop_bodies_by_trip_count_and_skip_free_ops():
    res = step_kernels.launches(HLO)
    # entry: a fusion and a custom call; the loop's body (2) and condition (its compare) each of 3 trips
    assert res["per_step"] == 2 + 2 * 3 + 1 * 3 and res["in_loops_of_unknown_trip"] == 0
    assert res["computations"]["loop_body"]["trip"] == 3 and res["computations"]["main"]["launches"] == 2
    assert "fused_computation" not in res["computations"] and res["computations"]["loop_cond"]["launches"] == 1
    assert res["by_kind"]["custom-call:__gpu$xla.gpu.triton"] == 1 and res["by_kind"]["fusion:kLoop"] == 4


def test_each_launch_is_named_by_layer_scope_and_innermost_ds4jax_frame():
    res = step_kernels.launches(HLO)
    assert res["by_scope"]["layer1+2j_csa/mul"] == 3 and res["by_scope"]["layer0_sliding/sinkhorn"] == 1
    assert res["by_scope"]["(outside layers)/embed"] == 1
    assert res["by_layer"] == {"(outside layers)": 1 + 3, "layer0_sliding": 1, "layer1+2j_csa": 2 * 3}
    # frame 2 is jax's einsum called from linear._one_row: the ds4jax frame names the launch
    assert res["by_source"]["ds4jax/model/layers/linear.py:_one_row:53"] == 3
    assert res["by_source"]["(no stack frame)"] == 2 + 3 + 3  # the entry's two, f2 and the loop's compare 3 times


def test_dynamic_slice_copies_are_weighed_by_their_results_and_trips():
    """A scanned layer's weight cut out of its stack (an async dynamic-slice fusion in the loop body) writes its
    result each trip: [2, 8] bf16 = 32 bytes x 3 trips; the operand stack and the async context are not counted,
    nor are other fusions."""
    start = ('  %ds = ((bf16[5,2,8]{2,1,0}, s32[]), bf16[2,8]{1,0}, u32[]) fusion-start(%x, %i), kind=kLoop, '
             'calls=%fused_dynamic_slice.3.clone\n  %dd = bf16[2,8]{1,0} fusion-done(%ds)\n')
    root = "  ROOT %r = (s32[], f32[4]{0}) tuple(%i, %f2)"
    body = HLO.replace(root, start + root)
    assert step_kernels.launches(HLO)["dynamic_slice_bytes_per_step"] == 0
    assert step_kernels.launches(body)["dynamic_slice_bytes_per_step"] == 2 * 8 * 2 * 3
    # the async pair launches one kernel (its start) each trip
    assert step_kernels.launches(body)["per_step"] == step_kernels.launches(HLO)["per_step"] + 3
    sync = HLO.replace("calls=%fused_computation, metadata={op_name=\"jit(step)/target/embed",
                       "calls=%fused_dynamic_slice, metadata={op_name=\"jit(step)/target/embed")
    assert step_kernels.launches(sync)["dynamic_slice_bytes_per_step"] == 4 * 4  # f32[4] once, in the entry


def test_copies_of_zero_element_arrays_are_counted_apart():
    """A zero-element array's copy (a zero-size pool array returned into its donated buffer) stays in the count
    and is reported apart: a memcpy of no bytes, not a kernel. Other copies are not."""
    copies = ('  %z = f32[0,1024]{1,0} copy(%c0)\n  %y = f32[3,0]{1,0} copy(%c1)\n'
              '  %n = f32[10,40]{1,0} copy(%c2)\n')
    entry = "  ROOT %out = f32[4]{0} get-tuple-element(%w), index=1"
    res = step_kernels.launches(HLO.replace(entry, copies + entry))
    assert res["per_step"] == step_kernels.launches(HLO)["per_step"] + 3
    assert res["zero_element_copies_per_step"] == 2 and step_kernels.launches(HLO)["zero_element_copies_per_step"] == 0
    assert "2 of them copies of zero-element arrays: memcpys" in step_kernels.render(res, "t")
