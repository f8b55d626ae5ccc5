#!/usr/bin/env bash
# One device call: distil the default model's MTP draft from its target (scripts/distill_draft.py, ~270 s of
# steps), then greedy speculative decoding at batch 1, k = 3 over the 8 held-out prompts with the shipped draft and
# with the distilled one (scripts/bench_default_speculative.py; plain measured in each run). Needs the corpus:
#   python scripts/default_corpus.py --out build/corpus      # here, then carry build/corpus to the device
# Usage (on the device): OUT=/path bash scripts/gpu_distill_draft.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt"
timeout 400 python3 scripts/distill_draft.py --checkpoint checkpoints/default --data build/corpus --out /tmp/distilled \
    --budget-s 270 --eval-windows 352 > "$OUT/distill.log" 2>&1
echo "distill exit $?" >> "$OUT/gpu.txt"
cp /tmp/distilled/params.safetensors /tmp/distilled/distill_report.json "$OUT/" 2>/dev/null
mkdir -p /tmp/spec
timeout 110 python3 scripts/bench_default_speculative.py --checkpoint checkpoints/default --ks 3 --batches 1 \
    --out /tmp/spec --json "$OUT/spec_before.json" > "$OUT/spec.log" 2>&1
echo "bench before exit $?" >> "$OUT/gpu.txt"
timeout 110 python3 scripts/bench_default_speculative.py --checkpoint /tmp/distilled --ks 3 --batches 1 \
    --out /tmp/spec --json "$OUT/spec_after.json" >> "$OUT/spec.log" 2>&1
echo "bench after exit $?" >> "$OUT/gpu.txt"
cat "$OUT/gpu.txt"; tail -5 "$OUT/distill.log"; grep -v "^ *$" "$OUT/spec.log" | tail -8
