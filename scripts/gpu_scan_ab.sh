#!/usr/bin/env bash
# One device call that times a change to the scanned layers on a card of any size (an H100 holds flash_slice(12) in
# the published format: FP8 dense + FP4 experts, its (HCA, CSA) pairs under lax.scan):
#   device  the `device` tests of the scanned path: the stacked kernels (mhc_pre, layer_matmul) and scanned ==
#           unrolled through the compiled kernels (tests/test_layer_of.py)
#   before  scripts/bench_quantized.py decode at batch 1 and 8 on the tree at $BEFORE (e.g. `mkdir .before && git
#           archive <sha> ds4jax pallas_kernels scripts pyproject.toml | tar -x -C .before`, carried)
#   after   the same on this tree
# Each side writes its JSON under $OUT/<side>/ with its per-layer check (the script exits non-zero when it fails).
# Usage (on the device): OUT=/path COMMIT=<sha> BEFORE=.before bash scripts/gpu_scan_ab.sh [device before after
# seconds: defaults 120 220 220]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_parts.sh  # wheels, OUT, the session log, part NAME SECONDS CMD...
bench=(env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 scripts/bench_quantized.py --quantized-only
       --layers "${LAYERS:-12}" --cases decode_b1_ctx2048,decode_b8_ctx2048)
# DEVICE_TESTS: the test paths of the device part (default: the scanned path's kernels and the one-token forms')
part device "${1:-120}" python3 -m pytest -q -m device -p no:cacheprovider ${DEVICE_TESTS:-tests/kernels/test_mhc_pre.py \
    tests/kernels/test_layer_matmul.py tests/kernels/test_grouped_matmul.py tests/test_layer_of.py}
if [ -n "${BEFORE:-}" ]; then
    part before "${2:-220}" bash -c "cd '$BEFORE' && PYTHONPATH=. ${bench[*]} --out '$OUT/before'"
fi
part after "${3:-220}" "${bench[@]}" --out "$OUT/after"
cat "$log"
