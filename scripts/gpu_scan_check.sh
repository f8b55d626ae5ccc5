#!/usr/bin/env bash
# Scanned layers on a GPU (session 17): does a scanned flash_slice(16) in the published format (FP8 dense + FP4
# experts) now decode near 4x the 4-layer step (session 16 measured 40.1 / 48.2 ms a step at b=1 / b=8 before the
# experts were read in place), with a profile to show what a step still copies; then the device tests.
# Usage (on the device): OUT=/path COMMIT=<sha> bash scripts/gpu_scan_check.sh [layers16 device layers4] (seconds;
# 0 skips a part)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_parts.sh
part layers16 "${1:-240}" env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 scripts/bench_quantized.py --quantized-only \
    --layers 16 --cases decode_b1_ctx2048,decode_b8_ctx2048 --profile --out "$OUT/layers16"
part device "${2:-240}" python3 -m pytest -q -m device -p no:cacheprovider tests/kernels tests/test_model_kernels.py \
    tests/test_quantized_weights.py tests/test_layer_of.py
part layers4 "${3:-0}" python3 scripts/bench_quantized.py --quantized-only --layers 4 \
    --cases decode_b1_ctx2048,decode_b8_ctx2048 --profile --out "$OUT/layers4"
cat "$log"
