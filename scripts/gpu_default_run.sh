#!/usr/bin/env bash
# One accelerator call: train the default model within a time budget, export it, then benchmark speculative vs
# plain decoding on it. Everything worth keeping lands in $OUT (at most 8 files, each < 16 MB):
#   run.log, model.safetensors (bf16), train_report.json, speculative.{json,md,png}
# Needs build/corpus (scripts/default_corpus.py) next to the code; downloads nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}
W=${WORKDIR:-/tmp/default_train}
log=$OUT/run.log
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >>"$log" 2>&1
python scripts/train_default.py --data build/corpus --workdir "$W" --budget-s "${TRAIN_BUDGET_S:-300}" \
    --all-heldout 2>&1 | tr '\r' '\n' >>"$log"
status=${PIPESTATUS[0]}
echo "train exit $status" >>"$log"
if [ -f "$W/model_safetensors/model.safetensors" ]; then
    cp "$W/model_safetensors/model.safetensors" "$W/model_safetensors/train_report.json" "$OUT/"
    ckpt="$W/model"
    [ -f "$ckpt/config.json" ] || ckpt="$W/model_safetensors"
    python scripts/bench_default_speculative.py --checkpoint "$ckpt" --out "$OUT" \
        --deadline-s "${BENCH_DEADLINE_S:-150}" >>"$log" 2>&1
    echo "bench exit $?" >>"$log"
fi
tail -c 6000 "$log"
