#!/usr/bin/env bash
# One accelerator call for the low-precision kernels and the cached CLI (issues 26 and 22), each part under its own
# time limit so a short device budget still brings back the parts that finished:
#   1. the device tests of the FP4 / FP8 grouped-expert kernels, the FP8 dense matmul, the Sinkhorn, indexer top-k
#      and sparse attention kernels
#   2. scripts/bench_kernels.py: the routed-expert grouped matmuls (FP4 default tiles, the FP4 kernel's first version,
#      bf16) at decode batch 1 and 8 and a 2048-token prefill, and the Sinkhorn kernel (exits 1 on a failed check)
#   3. scripts/bench_quantized.py on flash_slice(4): decode b=1 / b=8, bf16 vs FP8 dense + FP4 experts, with a trace
#   4. `ds4jax generate` cold, then cached under cProfile (where a cached start spends its seconds on a GPU), then
#      cached again with XLA_PYTHON_CLIENT_PREALLOCATE=false (is the first transfer paying for the preallocation?)
# Everything lands in one archive, $OUT/r.tgz (the device tool returns at most 8 files).
# Usage (on the device): OUT=/path bash scripts/gpu_quantized_kernels.sh [tests_s kernels_s quant_s cli_s]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; R=$(mktemp -d); mkdir -p "$OUT" "$R/quant"
log=$R/session.log
{ nvidia-smi --query-gpu=name --format=csv,noheader; git rev-parse HEAD 2>/dev/null; } >>"$log" 2>&1
part() {  # part NAME SECONDS CMD...: skipped when SECONDS is 0 (`timeout 0` would mean no limit)
  local name=$1 secs=$2; shift 2
  [ "$secs" -gt 0 ] || { echo "$name: skipped" >>"$log"; return; }
  local t=$SECONDS
  timeout "$secs" "$@" >"$R/$name.log" 2>&1
  echo "$name: exit $? after $((SECONDS - t)) s" >>"$log"
}
part device_tests "${1:-150}" python3 -m pytest -q -m device -p no:cacheprovider tests/kernels/test_grouped_matmul_fp4.py \
    tests/kernels/test_grouped_matmul_fp8.py tests/kernels/test_fp8_matmul.py tests/kernels/test_sinkhorn.py \
    tests/kernels/test_indexer_topk.py tests/kernels/test_sparse_attention.py
part kernels "${2:-120}" python3 scripts/bench_kernels.py --ops sinkhorn,fp4_gate_up,fp4_down,bf16_gate_up,bf16_down \
    --batches 1,8 --quick --variants "fp4:dots=group,decode=arith" --out "$R/kernels"
part quantized "${3:-170}" python3 scripts/bench_quantized.py --out "$R/quant" --profile \
    --cases decode_b1_ctx2048,decode_b8_ctx2048
export DS4JAX_COMPILATION_CACHE=$R/cli_cache
part cli_cold "${4:-80}" python3 -m ds4jax generate --prompt "def fibonacci(n):" --max-new-tokens 64
part cli_cached "${4:-80}" python3 -m cProfile -o "$R/cli_cached.prof" -m ds4jax generate \
    --prompt "def fibonacci(n):" --max-new-tokens 64
XLA_PYTHON_CLIENT_PREALLOCATE=false part cli_cached_noprealloc "${4:-80}" python3 -m cProfile \
    -o "$R/cli_noprealloc.prof" -m ds4jax generate --prompt "def fibonacci(n):" --max-new-tokens 64
python3 -c "import pstats, sys; pstats.Stats(sys.argv[1]).sort_stats('cumulative').print_stats(60)" \
    "$R/cli_cached.prof" >"$R/cli_cached_profile.txt" 2>&1
python3 -c "import pstats, sys; pstats.Stats(sys.argv[1]).sort_stats('cumulative').print_stats(60)" \
    "$R/cli_noprealloc.prof" >"$R/cli_noprealloc_profile.txt" 2>&1
rm -rf "$R/cli_cache"
tar czf "$OUT/r.tgz" -C "$R" .
cat "$log"
