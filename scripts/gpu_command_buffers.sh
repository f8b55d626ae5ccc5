#!/usr/bin/env bash
# Does XLA:GPU's command-buffer (CUDA graph) setting change the launch-bound default-model decode and speculative
# rounds at batch 1? The same bench_engine run (plain and k=3, batch 1) under three settings, one fresh process and
# an empty compilation cache each (XLA_FLAGS are part of every cache key):
#   default  XLA's own default command-buffer set
#   while    the default plus WHILE and CONDITIONAL (the decode and speculative loops are while loops: the whole
#            loop can replay as one graph instead of a host round trip per iteration for its condition)
#   off      no command buffers (what DS4JAX_COMMAND_BUFFERS=off / ROCm's default gives)
# Usage (on the device): OUT=/path bash scripts/gpu_command_buffers.sh [seconds per setting]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 DS4JAX_COMPILATION_CACHE=off
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
secs=${1:-100}
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 >"$OUT/gpu.txt"
for setting in default while off; do
  case $setting in
    default) flags="" ;;
    while) flags="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" ;;
    off) flags="--xla_gpu_enable_command_buffer=" ;;
  esac
  t=$SECONDS
  DS4JAX_COMMAND_BUFFERS=on XLA_FLAGS="$flags" timeout "$secs" python3 scripts/bench_engine.py --out "$OUT/cb_$setting" --models default \
      --batches 1,8 --ks 3 --b1-prompts 4 --repeats 1 >"$OUT/cb_$setting.log" 2>&1
  echo "$setting (XLA_FLAGS='$flags'): exit $? after $((SECONDS - t)) s"
done
python3 scripts/command_buffers_report.py "$OUT" --out "$OUT/command_buffers"
