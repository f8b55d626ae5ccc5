#!/usr/bin/env bash
# The FP4 GEMV's word-wise float16 decode (`pallas_kernels/grouped_matmul_fp4/decode_f16.py`, decode="f16", the
# default) on a GPU against the byte-wise decodes, then the quantized decode step it serves, then the device tests:
#   probe    scripts/probe_fp4_words.py: every decode at Flash dims, each output checked against the reference
#   kernels  scripts/bench_kernels.py: the GEMV alone at decode batches 1 and 8 (gate + up and down at Flash dims),
#            device time, the default ("f16") against "fp8" and "quarter" at the same tiles
#   step     scripts/bench_quantized.py --quantized-only: flash_slice(STEP_LAYERS, default 4) in the published format
#            (FP8 dense + FP4 experts, no bf16 copy: fits an H100), decode at batch 1 and 8, one step a call and the
#            engine's 8-step loop, checked layer by layer against the reference kernels
#   device   the device tests of the kernels and of the models that use them
# Usage (on the device): OUT=/path COMMIT=<sha> bash scripts/gpu_fp4_words.sh [probe kernels step device seconds]
# (run in that order: a call cut short keeps the most telling parts)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_parts.sh
part probe "${1:-90}" python3 scripts/probe_fp4_words.py --out "$OUT/probe/fp4_words"
g="block_n=128,k_splits=16,dots=group"
part kernels "${2:-150}" python3 scripts/bench_kernels.py --ops fp4_gemv_gate_up,fp4_gemv_down --batches 1,8 \
    --variants "fp4gemv:$g,decode=f16;fp4gemv:$g,decode=fp8;fp4gemv:$g,decode=quarter" --out "$OUT/kernels/kernels"
part step "${3:-150}" python3 scripts/bench_quantized.py --quantized-only --layers "${STEP_LAYERS:-4}" \
    --cases decode_b1_ctx2048,decode_b8_ctx2048 --out "$OUT/step"
part device "${4:-150}" python3 -m pytest -q -m device -p no:cacheprovider tests/kernels/test_grouped_gemv_fp4.py \
    tests/test_model_kernels.py tests/test_quantized_weights.py
cat "$log"
