#!/usr/bin/env bash
# Issue 22 on the GPU, one call: where a cold CLI start-up's seconds go beyond the compiler's own scopes.
#   load      scripts/load_probe.py (loading the default model, its parts, transfers leaf by leaf / as one buffer),
#             as it is and with XLA_PYTHON_CLIENT_PREALLOCATE=false
#   phases    scripts/compile_phases.py --cli (XLA's scopes in the CLI's cold generate call), as it is and with
#             --xla_gpu_autotune_level=0
#   device    the `device` tests (DEVICE_TESTS, default: the kernel tests and the model-through-kernels tests)
# Usage (on the device): OUT=/path COMMIT=<sha> bash scripts/gpu_load_compile.sh [load phases device seconds]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_parts.sh  # wheels, OUT, the session log, part NAME SECONDS CMD...
part load "${1:-60}" bash -c 'python3 scripts/load_probe.py --label prealloc --out "$OUT/load/prealloc.json"
    XLA_PYTHON_CLIENT_PREALLOCATE=false python3 scripts/load_probe.py --label noprealloc \
        --out "$OUT/load/noprealloc.json"'
part phases "${2:-120}" bash -c 'export DS4JAX_COMPILATION_CACHE=off
    python3 scripts/compile_phases.py --cli --out "$OUT/phases/cli.json"
    XLA_FLAGS=--xla_gpu_autotune_level=0 python3 scripts/compile_phases.py --cli --out "$OUT/phases/cli_at0.json"'
part device "${3:-90}" python3 -m pytest -q -m device -p no:cacheprovider ${DEVICE_TESTS:-tests/kernels tests/test_model_kernels.py}
cat "$log"
