#!/usr/bin/env bash
# The H200 measurements issues 26 and 27 ask for at the final commit, one part per device call if need be (each part
# under its own limit, packed as it ends; see scripts/gpu_parts.sh):
#   e2e        scripts/bench_e2e.py, ds4jax and HF transformers in one invocation, flash_slice(4) bf16: every case
#              at 2k (the batch-8 prefill, 32k decodes and 8k prefill only with E2E_SKIP=...: ~4 min for the rest)
#   quantized  scripts/bench_quantized.py --profile --fp8-kv: bf16 vs FP8 dense + FP4 experts vs + FP8 KV cache
#              (docs/benchmarks/quantized.*)
#   startup    scripts/bench_compile.py --parts engine,cli: default-model warm-up and CLI first byte, cold and cached
#   device     every test marked `device`
# flash_slice(4) in bf16 is 68 GB: call the device tool with needs_h200 (an H100 cannot load it; the script refuses
# the first two parts on a card under 100 GB rather than spend their time on an OOM).
# Usage (on the device): OUT=/path COMMIT=<sha> bash scripts/gpu_h200_check.sh [e2e quantized startup device]
# (seconds per part; 0 skips one; defaults 330 230 0 0 fit one 600 s call; then e.g. `... 0 0 110 200`).
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
cat "$log"
