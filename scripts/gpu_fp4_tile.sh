#!/usr/bin/env bash
# The FP4 tile kernel (prefill, verification) with the word-wise float16 decode (`BlockSizes(decode="f16")`) against
# its default "bits" decode on a GPU, and where a quantized prefill's time goes:
#   kernels  scripts/bench_kernels.py: one MoE layer's routed-expert grouped matmuls (gate + up, down; Flash dims,
#            top-6 of 256) for 8 and 2048 tokens, device time, each output checked: the default tiles, "f16" at the
#            default's stages (2 at 64-row tiles, 3 at 16-row tiles), and the bf16 kernel on the same routing
#   prefill  scripts/bench_quantized.py --quantized-only --profile: flash_slice(4) in the published format (fits an
#            H100), a 2048-token prefill timed and traced (its heaviest kernels), checked layer by layer
#   device   the tile kernel's device tests (both decodes)
# Usage (on the device): OUT=/path COMMIT=<sha> bash scripts/gpu_fp4_tile.sh [kernels prefill device seconds]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_parts.sh
part kernels "${1:-170}" python3 scripts/bench_kernels.py --ops fp4_gate_up,fp4_down,bf16_gate_up,bf16_down \
    --batches 8,2048 --variants "fp4:num_stages=2,decode=f16;fp4:decode=f16" --out "$OUT/kernels/kernels"
part prefill "${2:-140}" python3 scripts/bench_quantized.py --quantized-only --profile --cases prefill_b1_s2048 \
    --out "$OUT/prefill"
part device "${3:-60}" python3 -m pytest -q -m device -p no:cacheprovider tests/kernels/test_grouped_matmul_fp4.py
cat "$log"
