#!/usr/bin/env bash
# The H200 measurements issues 26 and 27 ask for at the final commit, one part per device call if need be (each part
# under its own limit, packed as it ends; see scripts/gpu_parts.sh):
#   e2e        scripts/bench_e2e.py, ds4jax and HF transformers in one invocation, flash_slice(4) bf16: every case
#              at 2k (the batch-8 prefill, 32k decodes and 8k prefill only with E2E_SKIP=...: ~4 min for the rest)
#   quantized  scripts/bench_quantized.py --profile --fp8-kv: bf16 vs FP8 dense + FP4 experts vs + FP8 KV cache
#              (docs/benchmarks/quantized.*)
#   startup    scripts/bench_compile.py --parts engine,cli: default-model warm-up and CLI first byte, cold and cached
#   device     every test marked `device`
#   kernels    scripts/step_kernels.py (flash_slice(4) decode at 1 and 8 rows: launches by source line) and
#              scripts/bench_kernels.py for the FP4 GEMV and the bf16 grouped matmul at decode and prefill sizes
#   largest    scripts/bench_quantized.py --quantized-only: the largest flash_slice(n) one card holds in the published
#              format (n = LARGEST_LAYERS, default 28: docs/benchmarks/quantized_fit.md), decode b=1 and b=8
# flash_slice(4) in bf16 is 68 GB: call the device tool with needs_h200 (an H100 cannot load it; the script refuses
# the first two parts on a card under 100 GB rather than spend their time on an OOM).
# Usage (on the device): OUT=/path COMMIT=<sha> bash scripts/gpu_h200_check.sh [e2e quantized startup device kernels
# largest] (seconds per part; 0 skips one; defaults 330 230 0 0 0 0 fit one 600 s call; then e.g. `0 0 110 200 90`).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_parts.sh  # wheels, OUT, the session log, BIG_GPU, part NAME SECONDS CMD...
BIG=$BIG_GPU
[ "$BIG" = 1 ] || echo "GPU memory ${GPU_MIB:-unknown} MiB: e2e and quantized skipped (flash_slice(4) needs ~68 GB)" >>"$log"
part e2e "$([ "$BIG" = 1 ] && echo "${1:-330}" || echo 0)" python3 scripts/bench_e2e.py --out "$OUT/e2e" \
    --sides ds4jax,hf --commit "${COMMIT:-unknown}" \
    --skip "${E2E_SKIP:-prefill_b8_s2048,decode_b1_ctx32768,decode_b8_ctx32768,prefill_b1_s8192}"
part quantized "$([ "$BIG" = 1 ] && echo "${2:-230}" || echo 0)" python3 scripts/bench_quantized.py --out "$OUT/quantized" \
    --profile --fp8-kv
part startup "${3:-0}" python3 scripts/bench_compile.py --parts engine,cli --engine-models default \
    --deadline-s $(( ${3:-110} - 25 )) --out "$OUT/startup/startup.json"
part device "${4:-0}" python3 -m pytest -q -m device -p no:cacheprovider tests/
part kernels "${5:-0}" bash -c 'for r in 1 8; do python3 scripts/step_kernels.py --out "$OUT/kernels" --rows $r; done
    rm -f "$OUT"/kernels/*.hlo.txt; python3 scripts/bench_kernels.py --ops fp4_gemv_gate_up,fp4_gemv_down,bf16_gate_up,bf16_down \
    --batches 1,8 --out "$OUT/kernels/kernels"'
# (JAX may take 95 % of the card here: the reference check dequantizes a layer beside the 28 layers' ~100 GiB)
part largest "$([ "$BIG" = 1 ] && echo "${6:-0}" || echo 0)" env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 \
    python3 scripts/bench_quantized.py --quantized-only --layers "${LARGEST_LAYERS:-28}" \
    --cases decode_b1_ctx2048,decode_b8_ctx2048 --out "$OUT/largest"
cat "$log"
