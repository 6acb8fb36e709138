#!/usr/bin/env bash
# Tree attention on one CUDA GPU (torch + triton only; no verl / ray needed), results into $OUT:
#   1. GPU / torch facts                                   -> $OUT/env.txt
#   2. correctness: tests/core/test_tree_attention_cuda.py -> $OUT/pytest_tree_attention_cuda.txt,
#      (blocked tree_attention and compiled flex + tree_block_mask vs per-row attention, fp32 + bf16, fwd + bwd)
#                                                             $OUT/tree_attention_cuda_errors.json
#   3. benchmark bf16, 28/4 heads x 128                    -> $OUT/bench_tree_attention_h100.{json,txt,log}
#      (.log: the script's stderr, compile warnings)
#   4. if time is left: benchmark fp32 without flex        -> $OUT/bench_tree_attention_h100_fp32_noflex.{json,txt,log}
#   summary (exit code and seconds of each stage)          -> $OUT/summary.txt
# Every stage has its own timeout; the whole stays under ~5.5 minutes (expected 3-4).  Usage (repo root):
#   OUT=/some/dir bash scripts/gpu_tree_attention.sh
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-$(command -v python || command -v python3)}"
DEADLINE=315  # seconds from the start: no stage starts after, none runs past (plus ~10 s to kill one)
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
exec 3>&1  # stage messages: to the console, never into a result file

# shellcheck source=scripts/gpu_stages.sh
. scripts/gpu_stages.sh  # stage, left

# 1. facts
{
  date -u
  nvidia-smi --query-gpu=name,memory.total --format=csv || echo "nvidia-smi failed"
  "$PY" - <<'EOF'
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton
    print("triton", triton.__version__)
except Exception as e:
    print("triton: not importable:", e)
print("cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
import verl_traj.core.kernels.tree_attention  # noqa: F401  (torch + numpy only)
print("import verl_traj.core.kernels.tree_attention: ok")
EOF
} 2>&1 | tee "$OUT/env.txt"

# 2. correctness (pytest; flex compiled once per dtype)
export VERL_TRAJ_TREE_ATTN_REPORT="$OUT/tree_attention_cuda_errors.json"
# (output straight into files, no pipe: a stray compile worker cannot hold a pipe open; $OUT survives a kill)
T="$OUT/pytest_tree_attention_cuda.txt"
stage pytest 150 "$PY" -m pytest -q -s -rs -p no:cacheprovider --durations=8 \
  tests/core/test_tree_attention_cuda.py >"$T" 2>&1
tail -n 70 "$T"

# 3. benchmark, bf16 (compile of the flex variants excluded from the timings; the JSON comes at the end)
table() {  # JSON file -> markdown table
  [ -s "$1" ] || { echo "(no JSON in $1)"; return 1; }
  "$PY" -c "import json, sys; sys.path.insert(0, 'scripts'); import bench_tree_attention as b; \
print(b.table(json.load(open(sys.argv[1]))))" "$1"
}
B="$OUT/bench_tree_attention_h100"
limit=$(left)
if [ "$limit" -ge 60 ]; then
  stage bench_bf16 "$limit" "$PY" scripts/bench_tree_attention.py --device cuda --dtype bfloat16 --heads 28 \
    --kv-heads 4 --head-dim 128 --repeats 5 --json >"$B.json" 2>"$B.log"
  tail -n 20 "$B.log"
  table "$B.json" 2>&1 | tee "$B.txt"
else
  echo "bench_bf16 skipped: ${limit}s left" | tee -a "$SUMMARY"
fi

# 4. fp32, no flex (max_err of the blocked / sdpa tree at full size), only if time is left
B32="$OUT/bench_tree_attention_h100_fp32_noflex"
limit=$(left)
if [ "$limit" -ge 45 ]; then
  stage bench_fp32_noflex "$limit" "$PY" scripts/bench_tree_attention.py --device cuda --dtype float32 --heads 28 \
    --kv-heads 4 --head-dim 128 --repeats 2 --no-flex --json >"$B32.json" 2>"$B32.log"
  tail -n 20 "$B32.log"
  table "$B32.json" 2>&1 | tee "$B32.txt"
else
  echo "bench_fp32_noflex skipped: ${limit}s left" | tee -a "$SUMMARY"
fi

echo "total ${SECONDS}s" >>"$SUMMARY"
echo "=== summary ($OUT/summary.txt)"
cat "$SUMMARY"
! grep -q -E 'rc=[1-9]' "$SUMMARY"
