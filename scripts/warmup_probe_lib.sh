# Sourced by the GPU compile probes (scripts/gpu_compile_probe.sh, gpu_compile_flags.sh, gpu_autotune_adaptive.sh):
# `probe LABEL LIMIT_S [ENV=VALUE...] [-- ARGS...]` runs scripts/warmup_probe.py once in a fresh process with the
# compilation cache off, the given environment and decode speed measured after warm-up, appending its record to
# $res and its output to $log (both set by the caller).
probe() {
    local label=$1 limit=$2; shift 2
    local envs=() t=$SECONDS
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
    [ $# -gt 0 ] && shift
    env DS4JAX_COMPILATION_CACHE=off "${envs[@]}" timeout "$limit" python3 scripts/warmup_probe.py --label "$label" \
        --out "$res" --speed "$@" >>"$log" 2>&1
    echo "== $label: exit $? after $((SECONDS - t)) s" | tee -a "$log"
}
