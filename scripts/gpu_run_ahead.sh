#!/usr/bin/env bash
# Run-ahead decoding on the GPU, one call: the engine bench (plain vs k=3 vs adaptive, engine vs fused loop) at
# batch 1, 8, 32, then the server bench at 1 and 32 clients with run-ahead on and off (DS4JAX_RUN_AHEAD=0) on
# one compilation cache, so the two server runs meet the same machine. Needs the serve wheels in .whl/.
# Usage: OUT=/path bash scripts/gpu_run_ahead.sh
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DS4JAX_COMPILATION_CACHE=$(mktemp -d)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/engine" "$OUT/serve_on" "$OUT/serve_off"
log=$OUT/session.log
t=$SECONDS
timeout 200 python3 scripts/bench_engine.py --out "$OUT/engine" --models default --batches 1,8,32 --ks 3 \
    --repeats 2 --deadline-s 180 >"$OUT/engine.log" 2>&1
echo "engine bench: exit $? after $((SECONDS - t)) s" | tee -a "$log"
t=$SECONDS
timeout 130 python3 scripts/bench_serve.py --out "$OUT/serve_on" --clients 1,32 --repeats 2 >"$OUT/serve_on.log" 2>&1
echo "serve bench, run-ahead on: exit $? after $((SECONDS - t)) s" | tee -a "$log"
t=$SECONDS
DS4JAX_RUN_AHEAD=0 timeout 100 python3 scripts/bench_serve.py --out "$OUT/serve_off" --clients 1,32 --repeats 2 \
    >"$OUT/serve_off.log" 2>&1
echo "serve bench, run-ahead off: exit $? after $((SECONDS - t)) s" | tee -a "$log"
