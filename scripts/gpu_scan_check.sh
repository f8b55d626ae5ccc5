#!/usr/bin/env bash
# Scanned layers on a GPU (session 17): the published format (FP8 dense + FP4 experts) in scanned flash_slice(n),
# its experts and FP8 dense linears read in their stacks (ds4jax/model/layer_of.py); session 16's H100 measured
# 40.1 / 48.2 ms a step at b=1 / b=8 for n=16 before either, this session's H200 6.3 ms at b=1 with the experts
# only. Parts: the device tests of the kernels that read stacks (and of operands past 2 GiB), flash_slice(16),
# then the largest slice one H200 holds (LARGEST_LAYERS, default 28; ~100 GiB) with its projection to 43 layers.
# Usage (on the device): OUT=/path COMMIT=<sha> bash scripts/gpu_scan_check.sh [device layers16 largest] (seconds;
# 0 skips a part)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_parts.sh
part device "${1:-120}" python3 -m pytest -q -m device -p no:cacheprovider tests/kernels/test_fp8_matmul.py \
    tests/kernels/test_large_operands.py tests/kernels/test_grouped_gemv_fp4.py tests/test_layer_of.py
part layers16 "${2:-240}" env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 scripts/bench_quantized.py --quantized-only \
    --layers 16 --cases decode_b1_ctx2048,decode_b8_ctx2048 --out "$OUT/layers16"
part largest "$([ "$BIG_GPU" = 1 ] && echo "${3:-0}" || echo 0)" env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 \
    python3 scripts/bench_quantized.py --quantized-only --layers "${LARGEST_LAYERS:-28}" \
    --cases decode_b1_ctx2048,decode_b8_ctx2048 --out "$OUT/largest"
cat "$log"
