#!/usr/bin/env bash
# Issue 22 on the GPU: where a cold Engine warm-up's compile time goes (the compiler's trace scopes,
# scripts/compile_phases.py) and what XLA flags / engine settings cut it, each variant in a fresh process with
# the compilation cache off and its decode speed measured after warm-up (scripts/warmup_probe.py --speed), then a
# cached warm-up (a second process on the cache the first filled). Usage: OUT=/path bash scripts/gpu_compile_probe.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
res=$OUT/warmup_probe.jsonl; log=$OUT/compile_probe.log
source scripts/warmup_probe_lib.sh  # probe()
t=$SECONDS
DS4JAX_COMPILATION_CACHE=off timeout 120 python3 scripts/compile_phases.py --out "$OUT/compile_phases.json" \
    >"$OUT/compile_phases.log" 2>&1; echo "== phases: exit $? after $((SECONDS - t)) s" | tee -a "$log"
probe baseline 100
probe ptxas_O0 100 XLA_FLAGS=--xla_gpu_disable_gpuasm_optimizations=true
probe scan2 100 DS4JAX_SCAN_MIN_REPEATS=2
probe rows_1_8 100 -- --row-buckets 1,8
probe combined 100 "XLA_FLAGS=--xla_gpu_disable_gpuasm_optimizations=true --xla_llvm_disable_expensive_passes=true" \
    DS4JAX_SCAN_MIN_REPEATS=2 -- --row-buckets 1,8
# the cached warm-up, traced: fill a cache, then a second process reads it
cache=$(mktemp -d)
DS4JAX_COMPILATION_CACHE=$cache timeout 100 python3 scripts/warmup_probe.py --label fill --out "$res" >>"$log" 2>&1
t=$SECONDS
DS4JAX_COMPILATION_CACHE=$cache timeout 60 python3 scripts/compile_phases.py --out "$OUT/compile_phases_cached.json" \
    >"$OUT/compile_phases_cached.log" 2>&1; echo "== cached phases: exit $? after $((SECONDS - t)) s" | tee -a "$log"
DS4JAX_COMPILATION_CACHE=$cache timeout 60 python3 scripts/warmup_probe.py --label cached --out "$res" >>"$log" 2>&1
echo "== total $SECONDS s" | tee -a "$log"
