#!/usr/bin/env bash
# One GPU call, two questions. Issue 22: does a lower XLA autotune level (1: autotune without checking results
# against a reference; 2, 3: fewer buffer initialisations) cut the default model's cold warm-up without slowing
# decoding (level 0 did slow it: compile_flags_h200.md)? Issue 23: plain vs k=3 vs adaptive at 8, 16 and 32 rows
# after the last-round accounting fix. Usage: OUT=/path bash scripts/gpu_autotune_adaptive.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
res=$OUT/warmup_probe.jsonl; log=$OUT/session.log
source scripts/warmup_probe_lib.sh  # probe()
for level in 4 1 2; do
    probe "autotune_$level" 90 XLA_FLAGS=--xla_gpu_autotune_level=$level
done
t=$SECONDS
DS4JAX_COMPILATION_CACHE=$(mktemp -d) timeout 300 python3 scripts/bench_engine.py --out "$OUT" --models default \
    --batches 8,16,32 --ks 3 --repeats 2 --deadline-s 280 >"$OUT/engine.log" 2>&1
echo "== engine bench: exit $? after $((SECONDS - t)) s" | tee -a "$log"
