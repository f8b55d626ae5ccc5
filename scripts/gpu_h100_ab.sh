#!/usr/bin/env bash
# One device call that checks a decode-step change on a card of any size (an H100 holds flash_slice(2), not (4)):
#   device   the `device` tests of the given files (default: the kernel tests and the model-through-kernels tests)
#   kernels  scripts/step_kernels.py: flash_slice(4) decode at 1 and 8 rows, kernel launches by source line;
#            scripts/probe_gemv.py: how one-token projections compile
#   e2e      scripts/bench_e2e.py --layers 2: this tree and the tree at $BEFORE (e.g. `git archive <sha> ds4jax
#            pallas_kernels scripts pyproject.toml | tar -x -C .before`, carried) in one run, decode at batch 1 and
#            8 and the 2048-token prefill
# Usage (on the device): OUT=/path COMMIT=<sha> BEFORE=.before BEFORE_LABEL=<sha> bash scripts/gpu_h100_ab.sh \
#   [device kernels e2e seconds: defaults 90 150 330]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_parts.sh  # wheels, OUT, the session log, part NAME SECONDS CMD...
part device "${1:-90}" python3 -m pytest -q -m device -p no:cacheprovider ${DEVICE_TESTS:-tests/kernels tests/test_model_kernels.py}
part kernels "${2:-150}" bash -c 'for r in 1 8; do python3 scripts/step_kernels.py --out "$OUT/kernels" --rows $r; done
    rm -f "$OUT"/kernels/*.hlo.txt; python3 scripts/probe_gemv.py --out "$OUT/kernels/probe_gemv.json"'
sides=ds4jax; [ -n "${BEFORE:-}" ] && sides=before,ds4jax
part e2e "${3:-330}" python3 scripts/bench_e2e.py --out "$OUT/e2e" --name e2e_l2 --layers 2 --sides "$sides" \
    --before-tree "${BEFORE:-.}" --before-label "${BEFORE_LABEL:-}" --commit "${COMMIT:-unknown}" \
    --skip prefill_b8_s2048,prefill_b1_s8192,decode_b1_ctx32768,decode_b8_ctx32768
cat "$log"
