#!/usr/bin/env bash
# Compile-time benchmark on the GPU (issue 22, deliverable 5): scripts/bench_compile.py with the Pallas kernels,
# each part under its own time limit so a short device budget still brings back the parts that finished:
#   1. compile: AOT lower + compile of the target decode / prefill / verify steps of flash_slice(n),
#      n in $LAYERS (default 2,4,8,16,43), unrolled and scanned, abstract params (no weights)
#   2. engine: Engine(model, max_slots=8, max_context=512).warmup() cold and cached in new processes, for the
#      default model and flash_slice(4) with random bf16 weights
#   3. cli: `ds4jax generate --prompt "def fibonacci(n):" --max-new-tokens 64` first token, cold and cached
# Usage (on the device): OUT=/path bash scripts/gpu_compile_session.sh [compile_s engine_s cli_s]  (0 skips a part)
# Defaults fit one ~420 s call; if the compile part does not finish, run it alone (e.g. `400 0 0`) and the rest in
# a second call (`0 300 100`), then merge here:
#   python scripts/bench_compile.py --render-only --out docs/benchmarks/compile.json A/compile_part.json B/...
# Each part stops starting measurements 25 s before its limit (--deadline-s) and writes its JSON after every
# record; a measurement not taken is an error record and a non-zero exit (logged in session.log).
# Brings back: session.log, compile.{json,md,png} (the parts merged), compile_parts.tgz (part JSONs and logs).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/parts"
log=$OUT/session.log
{ nvidia-smi --query-gpu=name,memory.total --format=csv; git rev-parse HEAD 2>/dev/null
  python3 -c 'import jax; print("jax", jax.__version__)'; } >>"$log" 2>&1
KERNELS=${KERNELS:-pallas}
run_part() {  # name limit_s args...
    local name=$1 limit=$2; shift 2
    [ "$limit" -gt 0 ] || return 0
    local t=$SECONDS
    timeout "$limit" python3 scripts/bench_compile.py --parts "$name" --kernels "$KERNELS" \
        --deadline-s $(( limit > 60 ? limit - 25 : limit / 2 )) --out "$OUT/parts/${name}_part.json" "$@" \
        >"$OUT/parts/$name.log" 2>&1
    echo "$name: exit $? after $((SECONDS - t)) s" >>"$log"
    grep -E ': [0-9.]+ s$|ERROR|NOT RUN' "$OUT/parts/$name.log" | cut -c1-200 >>"$log"
}
run_part compile "${1:-240}" --layers "${LAYERS:-2,4,8,16,43}" --layouts unrolled,scanned \
    --programs "${PROGRAMS:-decode,prefill,verify}"
run_part engine "${2:-120}" --engine-models "${ENGINE_MODELS:-default,flash_slice4}"
run_part cli "${3:-60}"
parts=$(ls "$OUT"/parts/*_part.json 2>/dev/null)
[ -n "$parts" ] && python3 scripts/bench_compile.py --render-only $parts --out "$OUT/compile.json" >>"$log" 2>&1
tar czf "$OUT/compile_parts.tgz" -C "$OUT" parts && rm -rf "$OUT/parts"
cat "$log"
