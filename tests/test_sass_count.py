"""scripts/sass_count.py: the innermost-loop finder on a disassembly, and (with the pip triton wheel's NVIDIA
backend, as the ROCm checks use) the GEMV's quarter decode issuing fewer loop instructions than its first, and the
word-wise float16 decode fewer per weight than the quarter one, in the GEMV and in the prefill tile kernel."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import sass_count  # noqa: E402

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LOP3.LUT R2, R3, 0x7, RZ, 0xc0, !PT ;
.L_x_0:
        /*0020*/                   FFMA R4, R2, R5, R4 ;
        /*0030*/                   IADD3 R6, R6, 0x1, RZ ;
        /*0040*/               @P0 BRA `(.L_x_0) ;
        /*0050*/              @!P1 BRA `(.L_x_1) ;
        /*0060*/                   EXIT ;
.L_x_2:
        /*0070*/                   BRA `(.L_x_2);
"""


def test_innermost_loop_is_the_shortest_backward_branch():
    assert sass_count.innermost_loop(SASS) == ["FFMA", "IADD3", "BRA"]
    assert [sass_count.classify(op) for op in ("FFMA", "IADD3", "BRA", "HGMMA", "F2FP.BF16", "LDG.E")] == [
        "float", "integer", "control", "tensor", "convert", "memory"]


def test_gemv_quarter_decode_is_shorter_than_the_first():
    from ds4jax.rocm_check.compile import triton_backends

    if "nvidia" not in triton_backends():
        pytest.skip("this triton wheel has no NVIDIA backend")
    got = sass_count.gemv_variants(8)
    assert got["gemv_quarter"]["loop_instructions"] < got["gemv_bits"]["loop_instructions"], got
    # and the word-wise float16 decode fewer per weight than either (two codes per mask and shift)
    per_weight = {name: r["instructions_per_weight_per_thread"] for name, r in got.items()}
    assert per_weight["gemv_f16_2_warps"] < per_weight["gemv_f16"] < per_weight["gemv_quarter"], per_weight


def test_tile_f16_decode_is_shorter_than_bits_at_prefill_tiles():
    from ds4jax.rocm_check.compile import triton_backends

    if "nvidia" not in triton_backends():
        pytest.skip("this triton wheel has no NVIDIA backend")
    got = sass_count.tile_variants(512, decodes=("bits", "f16"))
    per_weight = {name: r["instructions_per_weight_per_thread"] for name, r in got.items()}
    assert per_weight["tile_f16"] < 0.8 * per_weight["tile_bits"], per_weight  # 8.73 against 12.88 (sm90)
