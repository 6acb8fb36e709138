#!/usr/bin/env bash
# Resolve, without installing anything, the GPU stack scripts/install.sh --gpu installs: pip's resolver must accept
# verl_traj (this checkout) with verl 0.9.1's rollout extra for this machine's Python and platform, and flash-attn's
# pinned version must exist. Use a recent pip (it reads PyPI's metadata files instead of downloading wheels):
# PYTHON=.venv/bin/python after scripts/install.sh. Runs on any machine with PyPI access (no GPU needed); prints the resolved key versions.
#   bash scripts/check_gpu_pins.sh [vllm]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
FLASH_ATTN_VERSION=$(sed -n 's/^FLASH_ATTN_VERSION=//p' scripts/install.sh)
[ -n "$FLASH_ATTN_VERSION" ] || { echo "no FLASH_ATTN_VERSION= line in scripts/install.sh" >&2; exit 1; }
engines=("$@")
[ ${#engines[@]} -gt 0 ] || engines=(vllm)
report=$(mktemp -d)
trap 'rm -rf "$report"' EXIT
for engine in "${engines[@]}"; do
  "$PY" -m pip install --dry-run --ignore-installed --quiet --report "$report/$engine.json" ".[$engine]" >/dev/null
  "$PY" - "$report/$engine.json" "$engine" <<'PY'
import json, sys
items = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.load(open(sys.argv[1]))["install"]}
keys = ["verl", "torch", sys.argv[2], "transformers", "tensordict", "ray", "verl_traj"]
print(f"[{sys.argv[2]}] resolved {len(items)} packages: " + ", ".join(f"{k} {items.get(k.replace('_', '-'), items.get(k))}" for k in keys))
PY
done
# Capture pip's output first (matching inside a pipefail pipeline lets an early-exiting matcher break pip's pipe), tell
# a failed pip (network, index) apart from a missing version, and match the exact version in the comma-separated list
# pip prints ("Available versions: 2.8.3.post2, 2.8.3, ..."): 2.8.3.post1 or 12.8.3 is not 2.8.3.
if ! versions=$("$PY" -m pip index versions flash-attn 2>"$report/pip-index.err"); then
  echo "[flash-attn] cannot check $FLASH_ATTN_VERSION: 'pip index versions flash-attn' failed:" >&2
  cat "$report/pip-index.err" >&2
  exit 1
fi
available=$(sed -n 's/^Available versions: *//p' <<<"$versions" | tr -d '\r')
if [ -z "$available" ]; then
  echo "[flash-attn] cannot check $FLASH_ATTN_VERSION: no 'Available versions:' line in pip's output:" >&2
  printf '%s\n' "$versions" >&2
  exit 1
fi
case ", $available, " in
  *", $FLASH_ATTN_VERSION, "*)
    echo "[flash-attn] $FLASH_ATTN_VERSION is on PyPI (source distribution: built against the installed torch)" ;;
  *)
    echo "[flash-attn] $FLASH_ATTN_VERSION not found on PyPI (newest listed: $(cut -d, -f1-8 <<<"$available"))" >&2
    exit 1 ;;
esac
