#!/usr/bin/env bash
# One accelerator call that checks and measures what a session changed, most important first, each part under
# its own time limit so a short device budget still brings back the parts that finished:
#   1. every test marked `device` (Pallas kernels and the model's Pallas steps against the reference, on the GPU)
#   2. speculative vs plain decoding on the trained default model, batch 1 and 8 (scripts/bench_default_speculative.py)
#   3. end-to-end decode / prefill, ds4jax and HF transformers in the same invocation (scripts/bench_e2e.py)
#   4. the engine on 64 mixed-length requests, plain and speculative (scripts/bench_engine.py)
#   5. speculative vs plain on the tiny random model, every step on the dispatcher's kernels (bench_speculative.py)
# Usage (on the device): OUT=/path bash scripts/gpu_session.sh [device_s spec_s e2e_s engine_s tiny_s]  (0 skips a part)
# The device tool brings back only 8 files of $OUT and runs a command for at most 600 s: run a few parts per call
# (the e2e parts are packed into one archive).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_wheels.sh  # PYTHONPATH, and the carried serve wheels (.whl/)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
log=$OUT/session.log
{ nvidia-smi --query-gpu=name,memory.total --format=csv; git rev-parse HEAD 2>/dev/null; } >>"$log" 2>&1
# `timeout 0` means no limit at all, so a part given 0 seconds must be skipped here, not handed to timeout (a call
# that meant to skip the device tests and the speculative bench once ran both and spent the session's GPU budget)
d1=${1:-120} d2=${2:-150} d3=${3:-150} d4=${4:-150} d5=${5:-100}
t0=$SECONDS
[ "$d1" -gt 0 ] && timeout "$d1" python3 -m pytest -q -m device -p no:cacheprovider tests/ >"$OUT/device_tests.log" 2>&1
echo "device tests: exit $? after $((SECONDS - t0)) s" >>"$log"
tail -5 "$OUT/device_tests.log" >>"$log"
t1=$SECONDS
[ "$d2" -gt 0 ] && timeout "$d2" python3 scripts/bench_default_speculative.py --checkpoint checkpoints/default --out "$OUT" \
    --ks 3,2,1,4 --batches 1,8 --deadline-s $(( d2 - 40 )) >"$OUT/speculative.log" 2>&1
echo "speculative bench: exit $? after $((SECONDS - t1)) s" >>"$log"
t2=$SECONDS
[ "$d3" -gt 0 ] && timeout "$d3" python3 scripts/bench_e2e.py --out "$OUT" --sides "${E2E_SIDES:-ds4jax,hf}" \
    --skip "${E2E_SKIP:-prefill_b8_s2048,prefill_b1_s8192,decode_b1_ctx32768,decode_b8_ctx32768}" \
    --commit "$(git rev-parse HEAD 2>/dev/null || echo unknown)" >"$OUT/e2e.log" 2>&1
echo "e2e: exit $? after $((SECONDS - t2)) s" >>"$log"
rm -f "$OUT"/e2e_parts/*.npy; [ -d "$OUT/e2e_parts" ] && tar czf "$OUT/e2e_parts.tgz" -C "$OUT" e2e_parts && rm -rf "$OUT/e2e_parts"
t3=$SECONDS
mkdir -p "$OUT/engine" "$OUT/tiny"
[ "$d4" -gt 0 ] && timeout "$d4" python3 scripts/bench_engine.py --out "$OUT/engine" --new 32 >"$OUT/engine.log" 2>&1
echo "engine bench: exit $? after $((SECONDS - t3)) s" >>"$log"
t4=$SECONDS
[ "$d5" -gt 0 ] && timeout "$d5" python3 scripts/bench_speculative.py --ks 1,2 --new 32 --out "$OUT/tiny" >>"$log" 2>&1
echo "tiny speculative bench: exit $? after $((SECONDS - t4)) s" >>"$log"
cat "$log"
