# Sourced by the GPU check scripts (scripts/gpu_tree_attention.sh, scripts/gpu_update_ab.sh): each stage runs under its
# own timeout, its exit code and seconds go to $SUMMARY, its banner to fd 3 (the console, never a result file), and
# nothing starts after $DEADLINE seconds of the script.

stage() { # stage NAME TIMEOUT_S COMMAND... : run with a timeout, record rc and seconds
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "=== [$name] (timeout ${limit}s, t=${SECONDS}s): $*" >&3
  timeout --kill-after=10 "$limit" "$@"
  rc=$?
  local note=""
  case $rc in 124 | 137) note=" (TIMED OUT)" ;; esac
  echo "=== [$name] rc=$rc in $((SECONDS - t0))s$note" >&3
  echo "$name rc=$rc$note seconds=$((SECONDS - t0)) timeout=$limit" >>"$SUMMARY"
  return "$rc"
}

left() { echo $((DEADLINE - SECONDS)); }
