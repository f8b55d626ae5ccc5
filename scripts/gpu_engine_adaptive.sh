#!/usr/bin/env bash
# Issue 23 on the GPU, one call: plain vs k=3 vs the adaptive draft length through one Engine per model, at batch
# 1 (the 8 held-out prompts, one request at a time), 4, 8, 16 and 32 on the trained default model, and at 1 and 8
# on flash_slice(4) (random draft: acceptance ~0, so adaptive must fall back to plain). Engine vs fused loop too.
# Usage: OUT=/path bash scripts/gpu_engine_adaptive.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 DS4JAX_COMPILATION_CACHE=$(mktemp -d)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t=$SECONDS
timeout 570 python3 scripts/bench_engine.py --out "$OUT" --models default,flash --batches 1,4,8,16,32 --ks 3 \
    --b1-prompts 8 --flash-batches 1,8 --repeats 2 --deadline-s 520 >"$OUT/engine.log" 2>&1
echo "engine bench: exit $? after $((SECONDS - t)) s" | tee -a "$OUT/session.log"
