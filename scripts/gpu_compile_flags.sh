#!/usr/bin/env bash
# Issue 22 on the GPU, second probe: which XLA:GPU compile settings cut a cold Engine warm-up of the default model
# without slowing decoding (each variant a fresh process, compilation cache off, decode speed after warm-up), then
# a cached warm-up in a new process, then `ds4jax generate` to its first token cold and cached
# (scripts/bench_cli_startup.py). Usage: OUT=/path bash scripts/gpu_compile_flags.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
res=$OUT/warmup_probe.jsonl; log=$OUT/compile_flags.log
source scripts/warmup_probe_lib.sh  # probe()
probe baseline 90
probe no_triton_gemm 90 XLA_FLAGS=--xla_gpu_enable_triton_gemm=false
probe autotune_0 90 XLA_FLAGS=--xla_gpu_autotune_level=0
probe no_triton_gemm_autotune_0 90 "XLA_FLAGS=--xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=0"
cache=$(mktemp -d)
DS4JAX_COMPILATION_CACHE=$cache timeout 90 python3 scripts/warmup_probe.py --label fill --out "$res" >>"$log" 2>&1
DS4JAX_COMPILATION_CACHE=$cache timeout 60 python3 scripts/warmup_probe.py --label cached --out "$res" >>"$log" 2>&1
echo "== cached: exit $?" | tee -a "$log"
t=$SECONDS
JAX_PLATFORMS=cuda timeout 150 python3 scripts/bench_cli_startup.py --runs 2 --out "$OUT/cli_startup_h200.json" \
    >"$OUT/cli_startup_h200.log" 2>&1
echo "== cli startup: exit $? after $((SECONDS - t)) s" | tee -a "$log"
echo "== total $SECONDS s" | tee -a "$log"
