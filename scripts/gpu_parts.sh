# Sourced by the device-session scripts from the repository root: the carried wheels and PYTHONPATH
# (scripts/gpu_wheels.sh), OUT and its session log (the card and COMMIT written first), BIG_GPU (1 on a card of
# >= 100 GB: flash_slice(4) in bf16 is 68 GB and fails to load on an H100 after spending a part's time), and
# `part NAME SECONDS CMD...`, which runs one part under its own time limit (0 skips it: `timeout 0` would mean no
# limit), logs its exit status and time, and packs its folder $OUT/NAME into NAME.tgz at once (the device tool
# brings back at most 8 files, and a call cut short still brings back the parts that finished).
source scripts/gpu_wheels.sh
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export OUT
log=$OUT/session.log
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; echo "commit ${COMMIT:-unknown}"; } >>"$log" 2>&1
GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1 | tr -dc 0-9)
BIG_GPU=$([ "${GPU_MIB:-0}" -ge 100000 ] && echo 1 || echo 0)

part() {
  local name=$1 secs=$2; shift 2
  [ "$secs" -gt 0 ] || { echo "$name: skipped" >>"$log"; return; }
  local t=$SECONDS
  mkdir -p "$OUT/$name"
  timeout "$secs" "$@" >"$OUT/$name/log.txt" 2>&1
  echo "$name: exit $? after $((SECONDS - t)) s" >>"$log"
  tar czf "$OUT/$name.tgz" -C "$OUT" "$name" && rm -rf "${OUT:?}/$name"
}
