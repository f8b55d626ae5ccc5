# Sourced by the device-session scripts after they set OUT and log: `part NAME SECONDS CMD...` runs one part under
# its own time limit (0 skips it: `timeout 0` would mean no limit), logs its exit status and time, and packs its
# folder $OUT/NAME into NAME.tgz at once (the device tool brings back at most 8 files, and a call cut short still
# brings back the parts that finished).
part() {
  local name=$1 secs=$2; shift 2
  [ "$secs" -gt 0 ] || { echo "$name: skipped" >>"$log"; return; }
  local t=$SECONDS
  mkdir -p "$OUT/$name"
  timeout "$secs" "$@" >"$OUT/$name/log.txt" 2>&1
  echo "$name: exit $? after $((SECONDS - t)) s" >>"$log"
  tar czf "$OUT/$name.tgz" -C "$OUT" "$name" && rm -rf "${OUT:?}/$name"
}
