#!/usr/bin/env bash
# Issue 22 on the GPU: where a new process's start-up goes (scripts/startup_timeline.py), cold and cached, for the
# CLI's first token (`ds4jax generate --prompt "def fibonacci(n):" --max-new-tokens 64`) and the Engine's warm-up
# (default model), under variants. Each run is a fresh process; each variant a cold run on an empty cache directory,
# then a cached one on it.
# Usage (on the device): OUT=/path [BEFORE=.before] bash scripts/gpu_startup_probe.sh VARIANT...
#   VARIANT = KIND:LABEL[:ENV=VALUE[;ENV=VALUE...]], KIND one of cli, warmup, warmup_before (the warm-up of the
#   tree in $BEFORE, e.g. `git archive main ds4jax pallas_kernels scripts pyproject.toml | tar -x -C .before`)
#   e.g.  cli:base  cli:at0:XLA_FLAGS=--xla_gpu_autotune_level=0  warmup:base  warmup_before:base
# A variant with `speed` in its label also runs scripts/warmup_probe.py --speed (decode tokens/s after a warm-up)
# under the same environment; a `cli` variant with `prof` in its label runs the cached command once more under
# cProfile (where a cached start-up's seconds go, e.g. loading the weights: KIND_LABEL_profile.txt).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_parts.sh
source scripts/warmup_probe_lib.sh  # probe(): warmup_probe.py --speed, cache off, into $res / $log
dir=$OUT/timeline; mkdir -p "$dir"
CLI=(generate --prompt "def fibonacci(n):" --max-new-tokens 64)
timeline() {  # label tree limit env... -- args
    local label=$1 tree=$2 limit=$3; shift 3
    local envs=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
    local t=$SECONDS
    env PYTHONPATH="$tree" "${envs[@]}" timeout "$limit" python3 scripts/startup_timeline.py --label "$label" \
        --out "$dir/$label.json" "$@" >"$dir/$label.out" 2>"$dir/$label.err"
    echo "$label: exit $? after $((SECONDS - t)) s" >>"$log"
}
for variant in "$@"; do
    IFS=: read -r kind label envspec <<<"$variant"
    envs=(); [ -n "${envspec:-}" ] && IFS=';' read -r -a envs <<<"$envspec"
    tree=$PWD; args=(-- "${CLI[@]}")
    case $kind in
        cli) ;;
        warmup) args=(--warmup) ;;
        warmup_before) args=(--warmup); tree=$PWD/${BEFORE:?BEFORE names the other tree}
                       envs+=("DS4JAX_DEFAULT_CHECKPOINT=$PWD/checkpoints/default") ;;
        *) echo "unknown kind $kind" >>"$log"; continue ;;
    esac
    cache=$(mktemp -d)
    timeline "${kind}_${label}_cold" "$tree" 150 DS4JAX_COMPILATION_CACHE="$cache" "${envs[@]}" -- "${args[@]}"
    timeline "${kind}_${label}_cached" "$tree" 60 DS4JAX_COMPILATION_CACHE="$cache" "${envs[@]}" -- "${args[@]}"
    if [[ $kind == cli && $label == *prof* ]]; then
        prof=$dir/${kind}_$label.prof
        env PYTHONPATH="$tree" DS4JAX_COMPILATION_CACHE="$cache" "${envs[@]}" timeout 60 \
            python3 -m cProfile -o "$prof" -m ds4jax "${CLI[@]}" >/dev/null 2>>"$log"
        echo "${kind}_${label}_profile: exit $?" >>"$log"
        python3 -c 'import pstats, sys; s = pstats.Stats(sys.argv[1]); s.sort_stats("cumulative").print_stats(60)
s.sort_stats("tottime").print_stats(40)' "$prof" >"$dir/${kind}_${label}_profile.txt" 2>&1
        rm -f "$prof"
    fi
    if [[ $label == *speed* ]]; then  # its output in speed.log, its exit status there and on stdout
        (res=$OUT/warmup_probe.jsonl log=$dir/speed.log; probe "${kind}_$label" 120 PYTHONPATH="$tree" "${envs[@]}")
    fi
done
python3 scripts/startup_timeline.py --render "$dir"/*.json >"$OUT/timeline.md" 2>>"$log"
tar czf "$OUT/timeline.tgz" -C "$OUT" timeline && rm -rf "$dir"
cat "$log" "$OUT/timeline.md"
