#!/usr/bin/env bash
# Issue 22 on the GPU: where a new process's start-up goes (scripts/startup_timeline.py), cold and cached, for the
# CLI's first token and the Engine's warm-up, under variants: this tree against $BEFORE (another tree, e.g. main's
# before a change: `git archive main ds4jax pallas_kernels scripts pyproject.toml | tar -x -C .before`), XLA's
# autotuner off for the CLI (a one-shot, one-row run), and a streaming CLI run that compiles its decode program
# beside the prefill's. Each run is a fresh process, each cold run an empty cache directory.
# Usage (on the device): OUT=/path [BEFORE=.before] bash scripts/gpu_startup_probe.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_parts.sh
res=$OUT/timeline; mkdir -p "$res"
CLI=(generate --prompt "def fibonacci(n):" --max-new-tokens 64)
timeline() {  # label tree limit env... -- args
    local label=$1 tree=$2 limit=$3; shift 3
    local envs=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
    local t=$SECONDS
    env PYTHONPATH="$tree" "${envs[@]}" timeout "$limit" python3 scripts/startup_timeline.py --label "$label" \
        --out "$res/$label.json" "$@" >"$res/$label.out" 2>"$res/$label.err"
    echo "$label: exit $? after $((SECONDS - t)) s" >>"$log"
}
pair() {  # label tree env... -- args: a cold run on an empty cache, then a cached one on it
    local label=$1 tree=$2; shift 2
    local cache; cache=$(mktemp -d)
    timeline "${label}_cold" "$tree" 150 DS4JAX_COMPILATION_CACHE="$cache" "$@"
    timeline "${label}_cached" "$tree" 60 DS4JAX_COMPILATION_CACHE="$cache" "$@"
}
pair cli "$PWD" -- -- "${CLI[@]}"
pair cli_autotune0 "$PWD" XLA_FLAGS=--xla_gpu_autotune_level=0 -- -- "${CLI[@]}"
pair cli_ahead "$PWD" DS4JAX_COMPILE_AHEAD=always -- -- "${CLI[@]}"
pair warmup "$PWD" -- --warmup
[ -n "${BEFORE:-}" ] && pair warmup_before "$PWD/$BEFORE" DS4JAX_DEFAULT_CHECKPOINT="$PWD/checkpoints/default" -- --warmup
pair cli_again "$PWD" -- -- "${CLI[@]}"
python3 scripts/startup_timeline.py --render "$res"/*.json >"$OUT/timeline.md" 2>>"$log"
tar czf "$OUT/timeline.tgz" -C "$OUT" timeline && rm -rf "$res"
cat "$log" "$OUT/timeline.md"
