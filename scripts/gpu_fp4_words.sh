#!/usr/bin/env bash
# The FP4 GEMV's word-wise float16 decode (`pallas_kernels/grouped_matmul_fp4/decode_f16.py`, decode="f16") on a GPU
# against the byte-wise decodes: the kernel device tests, then the GEMV alone at decode batches 1 and 8 (gate + up
# and down at Flash dims) with "quarter" and "f16" at several tiles; first scripts/probe_fp4_words.py (every decode,
# each output checked against the reference).
# Usage (on the device): OUT=/path COMMIT=<sha> bash scripts/gpu_fp4_words.sh [device kernels probe seconds]
# (run in the order probe, kernels, device: a call cut short keeps the most telling parts)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_parts.sh
part probe "${3:-90}" python3 scripts/probe_fp4_words.py --out "$OUT/probe/fp4_words"
g="block_n=128,k_splits=16,dots=group"
variants="fp4gemv:$g,decode=quarter;fp4gemv:$g,decode=f16;fp4gemv:$g,decode=f16,num_warps=2"
variants+=";fp4gemv:$g,decode=f16,num_warps=1;fp4gemv:block_n=256,k_splits=16,dots=group,decode=f16"
variants+=";fp4gemv:block_n=256,k_splits=16,dots=group,decode=f16,num_warps=8"
variants+=";fp4gemv:block_n=128,k_splits=8,dots=group,decode=f16,num_warps=2"
variants+=";fp4gemv:block_n=128,k_splits=32,dots=group,decode=f16,num_warps=2"
variants+=";fp4gemv:block_n=64,k_splits=16,dots=group,decode=f16,num_warps=2"
part kernels "${2:-360}" python3 scripts/bench_kernels.py --ops fp4_gemv_gate_up,fp4_gemv_down --batches 1,8 \
    --variants "$variants" --out "$OUT/kernels/kernels"
part device "${1:-150}" python3 -m pytest -q -m device -p no:cacheprovider tests/kernels/test_grouped_gemv_fp4.py \
    tests/test_model_kernels.py tests/test_quantized_weights.py
cat "$log"
