#!/usr/bin/env bash
# The FP4 GEMV's decodes on a GPU (session 16): the device tests of the kernels and the model's kernel paths, the GEMV
# alone at decode batches 1 and 8 with its sweep (the default "quarter" decode, the first integer decode and the FP8
# conversion at the same tiles), and flash_slice(2) decode / prefill bf16 vs FP8 + FP4 (+ FP8 KV) with a profile.
# Usage (on the device): OUT=/path COMMIT=<sha> bash scripts/gpu_fp4_decode.sh [device kernels quantized seconds]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_parts.sh
part device "${1:-240}" python3 -m pytest -q -m device -p no:cacheprovider tests/kernels tests/test_model_kernels.py \
    tests/test_quantized_weights.py
part kernels "${2:-120}" python3 scripts/bench_kernels.py --ops fp4_gemv_gate_up,fp4_gemv_down --batches 1,8 --sweep \
    --out "$OUT/kernels/kernels"
part quantized "${3:-220}" python3 scripts/bench_quantized.py --layers 2 --profile --fp8-kv --out "$OUT/quantized"
cat "$log"
