#!/usr/bin/env bash
# Session 17's second H100 call: the device tests of operands past 2 GiB (with pallas_kernels/_wide_offsets.py) and
# of the FP4 GEMV (the first call's run of them died with the illegal address of the 3 GiB test, whose kernel then
# lowered through Mosaic GPU for want of compiler params), then flash_slice(16) decode at b=1 on the tree before
# the FP8 dense linears were read in place (OLD_TREE: a plain copy of commit 2724b6d's code), to set against this
# card's figure for the tree after (5.69 ms a step, 8 a call, bd102b9).
# Usage (on the device): OUT=/path COMMIT=<sha> OLD_TREE=old_tree bash scripts/gpu_offsets_check.sh [device before]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_parts.sh
part device "${1:-100}" python3 -m pytest -q -m device -p no:cacheprovider tests/kernels/test_large_operands.py \
    tests/kernels/test_grouped_gemv_fp4.py tests/kernels/test_fp8_matmul.py
part before "${2:-200}" bash -c "cd ${OLD_TREE:-old_tree} && PYTHONPATH=\$PWD XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 \
    python3 scripts/bench_quantized.py --quantized-only --layers 16 --cases decode_b1_ctx2048 --out $OUT/before"
cat "$log"
