#!/usr/bin/env bash
# Warm-up cost breakdown on the GPU (issue 22): scripts/warmup_probe.py in fresh processes, compilation cache off,
# under XLA / kernel variants, each bounded in time. Usage: OUT=/path bash scripts/gpu_warmup_probe.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD DS4JAX_COMPILATION_CACHE=off
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
res=$OUT/warmup_probe.jsonl; log=$OUT/warmup_probe.log
probe() {  # label limit_s env...
    local label=$1 limit=$2; shift 2
    local t=$SECONDS
    env "$@" timeout "$limit" python3 scripts/warmup_probe.py --label "$label" --out "$res" >>"$log" 2>&1
    echo "== $label: exit $? after $((SECONDS - t)) s" | tee -a "$log"
}
probe baseline 130
probe autotune0 110 XLA_FLAGS=--xla_gpu_autotune_level=0
probe reference_kernels 110 DS4JAX_KERNELS=reference
probe reference_autotune0 110 DS4JAX_KERNELS=reference XLA_FLAGS=--xla_gpu_autotune_level=0
