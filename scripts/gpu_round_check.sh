#!/usr/bin/env bash
# One accelerator call that measures this round's user-facing changes, most important first, each part under its
# own time limit and packed into its own archive as soon as it ends (a call cut short still brings back the parts
# that finished; the device tool returns at most 8 files):
#   branch     scripts/bench_engine.py, default model plain and k=3 at batch 1 and 8, with DS4JAX_GREEDY_BRANCH=off
#              then on (the greedy batches' skip of the sampling machinery, issue 23), a fresh process each
#   serve      scripts/bench_serve.py in process: 1, 8, 32, 64 clients, burst and sustained (issue 25)
#   anatomy    scripts/spec_anatomy.py: a speculative round vs a plain step (issue 23), command buffers on with the
#              greedy branch on and off (wall per step / round), then off (every kernel in the trace, by group)
#   startup    scripts/bench_compile.py --parts engine,cli: default-model warm-up and CLI first token, cold and
#              cached in new processes (issue 22)
#   serve_ep   bench_serve.py with --engine-process
#   e2e        scripts/bench_e2e.py, ds4jax side, flash_slice(4) decode at batch 1 and 8 (issue 27); H200 only (the
#              bf16 model is 68 GB: skipped on a card under 100 GB, where it fails to load)
#   scan       the layer-scan threshold: DS4JAX_SCAN_MIN_REPEATS=3 (the library's) then 2 (the test suite's), each a
#              fresh process: decode tokens/s of the default model and flash_slice(4) (bench_engine.py, plain and k=3, b=1
#              and 8) and the default model's engine warm-up cold (bench_compile.py). Scanning two repetitions
#              compiles faster on CPU at XLA level 0 and on the H200 (docs/benchmarks/compile.md); whether decoding
#              pays for the loop decides the library's default (issue 22's warm-up target); flash_slice(4) in bf16
#              (68 GB) needs the H200: on a smaller card the script measures the default model alone
#   serve_long bench_serve.py in process at 32 clients, 512 new tokens per request instead of 128
# Usage (on the device): OUT=/path COMMIT=<sha> bash scripts/gpu_round_check.sh [branch serve anatomy startup serve_ep e2e scan
# serve_long]
# (seconds per part; 0 skips it; the defaults, 150 120 100 110 0 80 0, fit one 600 s call; the scan part alone:
# `... gpu_round_check.sh 0 0 0 0 0 0 300`).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_parts.sh  # wheels, OUT, the session log, BIG_GPU, part NAME SECONDS CMD...
# on a card under 100 GB the parts that load flash_slice(4) in bf16 are skipped and the scan part measures the
# default model alone
if [ "$BIG_GPU" = 0 ]; then
  echo "GPU memory ${GPU_MIB:-unknown} MiB: e2e skipped, scan on the default model only (flash_slice(4) needs ~68 GB)" >>"$log"
  export SCAN_MODELS=${SCAN_MODELS:-default}
fi
# one compilation cache for both settings (outside $OUT: it would come back): the programs the flag leaves alone
# compile once, so the part fits its time on a host that compiles slowly (the H100's: ~90 s for the first setting)
part branch "${1:-150}" bash -c 'for b in off on; do DS4JAX_COMPILATION_CACHE=/tmp/ds4jax-branch-cache DS4JAX_GREEDY_BRANCH=$b \
    python3 scripts/bench_engine.py --out "$OUT/branch/$b" --models default --batches 1,8 --ks 3 --b1-prompts 4 \
    --repeats 1; done; python3 scripts/command_buffers_report.py "$OUT/branch" --compare greedy_branch \
    --out "$OUT/branch/greedy_branch"'
part serve "${2:-120}" python3 scripts/bench_serve.py --out "$OUT/serve" --name serve_in_process --in-process \
    --clients 1,8,32,64 --requests-per-client 4 --repeats 2
# (the wall per step and per round with command buffers on, the greedy branch on and off: what its conditionals
# cost; then every kernel, by group, with command buffers off: docs/benchmarks/spec_anatomy_h100_dab9779/)
part anatomy "${3:-100}" bash -c 'for b in on off; do DS4JAX_GREEDY_BRANCH=$b python3 scripts/spec_anatomy.py \
    --heldout 1 --no-hlo-scopes --out "$OUT/anatomy/auto_branch_$b"; done
    python3 scripts/spec_anatomy.py --heldout 1 --out "$OUT/anatomy/off" --command-buffers off'
part startup "${4:-110}" python3 scripts/bench_compile.py --parts engine,cli --engine-models default \
    --deadline-s $(( ${4:-110} - 25 )) --out "$OUT/startup/startup.json"
part serve_ep "${5:-0}" python3 scripts/bench_serve.py --out "$OUT/serve_ep" --name serve_engine_process \
    --clients 1,8,32,64 --requests-per-client 4 --repeats 2 --engine-process
part e2e "$([ "$BIG_GPU" = 1 ] && echo "${6:-80}" || echo 0)" python3 scripts/bench_e2e.py --out "$OUT/e2e" --sides ds4jax --commit "${COMMIT:-unknown}" \
    --skip prefill_b1_s2048,prefill_b8_s2048,prefill_b1_s8192,decode_b1_ctx32768,decode_b8_ctx32768
export SCAN_S=${7:-0}
part scan "$SCAN_S" bash -c 'for r in 3 2; do DS4JAX_COMPILATION_CACHE=off DS4JAX_SCAN_MIN_REPEATS=$r \
    python3 scripts/bench_engine.py --out "$OUT/scan/min$r" --models "${SCAN_MODELS:-default,flash}" --batches 1,8 --ks 3 --repeats 1 \
    --deadline-s $((SCAN_S / 4)); DS4JAX_SCAN_MIN_REPEATS=$r python3 scripts/bench_compile.py --parts engine \
    --engine-models default --deadline-s $((SCAN_S / 5)) --out "$OUT/scan/min$r/startup.json"; done'
# a longer generation at 32 clients: the server's fixed costs per request (HTTP, hand-over, admission: tens of ms
# in a burst) against 512 tokens' decoding instead of 128 (the goal's figure is the 128-token row of `serve`)
part serve_long "${8:-0}" python3 scripts/bench_serve.py --out "$OUT/serve_long" --name serve_in_process_new512 --in-process \
    --clients 32 --requests-per-client 1 --new 512 --repeats 2
cat "$log"
