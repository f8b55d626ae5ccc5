#!/usr/bin/env bash
# The FP4 kernels' word-wise float16 decode (`pallas_kernels/grouped_matmul_fp4/decode_f16.py`, decode="f16") on a
# GPU, then the quantized decode step it serves, then the kernels' device tests:
#   gemv     scripts/bench_kernels.py: the decode GEMV alone at batches 1 and 8 (gate + up and down at Flash dims),
#            device time, every output checked: the default ("f16") against "fp8" and "quarter" at the same tiles
#   tile     the same for the tile kernel (prefill, verification) at 8 and 2048 tokens: the default "bits" decode
#            against "f16" at 2 and 3 stages, and the bf16 kernel on the same routing
#   step     scripts/bench_quantized.py --quantized-only: flash_slice(STEP_LAYERS, default 4) in the published format
#            (FP8 dense + FP4 experts, no bf16 copy: fits an H100), decode at batch 1 and 8, one step a call and the
#            engine's 8-step loop, checked layer by layer against the reference kernels
#   device   the device tests of both FP4 kernels and of the models that use them
# Usage (on the device): OUT=/path COMMIT=<sha> bash scripts/gpu_fp4_words.sh [gemv tile step device seconds]
# (run in that order: a call cut short keeps the parts that finished). scripts/probe_fp4_words.py (host-timed
# loops over the GEMV's decodes) and scripts/gpu_fp4_tile.sh (with a traced quantized prefill) are the others.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_parts.sh
g="block_n=128,k_splits=16,dots=group"
part gemv "${1:-90}" python3 scripts/bench_kernels.py --ops fp4_gemv_gate_up,fp4_gemv_down --batches 1,8 \
    --variants "fp4gemv:$g,decode=fp8;fp4gemv:$g,decode=quarter" --out "$OUT/gemv/kernels"
part tile "${2:-150}" python3 scripts/bench_kernels.py --ops fp4_gate_up,fp4_down,bf16_gate_up,bf16_down \
    --batches 8,2048 --variants "fp4:num_stages=2,decode=f16;fp4:decode=f16" --out "$OUT/tile/kernels"
part step "${3:-150}" python3 scripts/bench_quantized.py --quantized-only --layers "${STEP_LAYERS:-4}" \
    --cases decode_b1_ctx2048,decode_b8_ctx2048 --out "$OUT/step"
part device "${4:-150}" python3 -m pytest -q -m device -p no:cacheprovider tests/kernels/test_grouped_gemv_fp4.py \
    tests/kernels/test_grouped_matmul_fp4.py tests/test_model_kernels.py tests/test_quantized_weights.py
cat "$log"
