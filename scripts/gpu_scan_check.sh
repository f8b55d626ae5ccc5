#!/usr/bin/env bash
# Scanned layers on a GPU (session 17): the published format (FP8 dense + FP4 experts) in scanned flash_slice(n),
# its experts and FP8 dense linears read in their stacks (ds4jax/model/layer_of.py); session 16's H100 measured
# 40.1 / 48.2 ms a step at b=1 / b=8 for n=16 before either, this session's H200 6.3 ms at b=1 with the experts
# only. Parts: the device tests of the kernels that read stacks (and of operands past 2 GiB), flash_slice(16)
# (checked layer by layer: scripts/layer_check.py), and bf16: flash_slice(6) decode scanned ((CSA, HCA) x 2 under
# DS4JAX_SCAN_MIN_REPEATS=2) against unrolled (DS4JAX_SCAN_LAYERS=0), whether XLA copies a scanned layer's bf16
# dense weights (~100 GB: an H200). The largest slice one H200 holds is gpu_h200_check.sh's `largest` part.
# Usage (on the device): OUT=/path COMMIT=<sha> bash scripts/gpu_scan_check.sh [device layers16 bf16scan]
# (seconds; 0 skips a part). Session 18 on an H100: the device tests need more than 100 s (19 passed, then the
# limit), and flash_slice(16)'s b=1 case more than 215 s (the model built, the timing, then the per-layer check's
# compiles and 16 layers' fills): hence the defaults 200 / 380 and one case (LAYERS16_CASES adds b=8).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_parts.sh
part device "${1:-200}" python3 -m pytest -q -m device -p no:cacheprovider tests/kernels/test_fp8_matmul.py \
    tests/kernels/test_large_operands.py tests/kernels/test_grouped_gemv_fp4.py tests/test_layer_of.py tests/test_model_gpu.py
part layers16 "${2:-380}" env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 scripts/bench_quantized.py --quantized-only \
    --layers 16 --cases "${LAYERS16_CASES:-decode_b1_ctx2048}" --out "$OUT/layers16"
E2E_DECODE_ONLY=prefill_b1_s2048,prefill_b8_s2048,prefill_b1_s8192,decode_b1_ctx32768,decode_b8_ctx32768
part bf16scan "$([ "$BIG_GPU" = 1 ] && echo "${3:-0}" || echo 0)" bash -c "
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 DS4JAX_SCAN_MIN_REPEATS=2 python3 scripts/bench_e2e.py --layers 6 \
        --sides ds4jax --name scanned6 --skip $E2E_DECODE_ONLY --out $OUT/bf16scan
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 DS4JAX_SCAN_LAYERS=0 python3 scripts/bench_e2e.py --layers 6 \
        --sides ds4jax --name unrolled6 --skip $E2E_DECODE_ONLY --out $OUT/bf16scan"
cat "$log"
