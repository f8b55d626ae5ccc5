#!/usr/bin/env bash
# Issues 23 and 25 on the GPU, one call: the engine (plain vs fixed k vs adaptive, engine vs fused loop) on the
# default model at batch 1, 4, 8, 16, 32, then the server against the Engine at 1, 8, 32, 64 streaming clients,
# then the same with the engine in a process of its own (`ds4jax serve --engine-process`, serve_engine_process.md),
# each part under its own time limit (a part cut by its limit still leaves its JSON: the scripts save as they go).
# Needs the serve extra's wheels in .whl/ (starlette, uvicorn, httptools; the image lacks them).
# Usage: OUT=/path bash scripts/gpu_engine_serve.sh [engine_s serve_s engine_process_s]
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/engine" "$OUT/serve"
log=$OUT/session.log
git rev-parse HEAD >>"$log" 2>&1
t=$SECONDS
timeout "${1:-300}" python3 scripts/bench_engine.py --out "$OUT/engine" --models default --batches 1,4,8,16,32 \
    --ks 1,2,3,4 --b1-prompts 8 --repeats 2 --deadline-s $(( ${1:-300} - 30 )) >"$OUT/engine.log" 2>&1
echo "engine bench: exit $? after $((SECONDS - t)) s" | tee -a "$log"
t=$SECONDS
timeout "${2:-240}" python3 scripts/bench_serve.py --out "$OUT/serve" --repeats 2 --in-process >"$OUT/serve.log" 2>&1
echo "serve bench: exit $? after $((SECONDS - t)) s" | tee -a "$log"
t=$SECONDS
timeout "${3:-240}" python3 scripts/bench_serve.py --out "$OUT/serve" --repeats 2 --engine-process \
    --name serve_engine_process >"$OUT/serve_engine_process.log" 2>&1
echo "serve bench (engine process): exit $? after $((SECONDS - t)) s" | tee -a "$log"
