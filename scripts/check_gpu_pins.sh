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
engines=("$@")
[ ${#engines[@]} -gt 0 ] || engines=(vllm)
report=$(mktemp -d)
for engine in "${engines[@]}"; do
  "$PY" -m pip install --dry-run --ignore-installed --quiet --report "$report/$engine.json" ".[$engine]" >/dev/null
  "$PY" - "$report/$engine.json" "$engine" <<'PY'
import json, sys
items = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.load(open(sys.argv[1]))["install"]}
keys = ["verl", "torch", sys.argv[2], "transformers", "tensordict", "ray", "verl_traj"]
print(f"[{sys.argv[2]}] resolved {len(items)} packages: " + ", ".join(f"{k} {items.get(k.replace('_', '-'), items.get(k))}" for k in keys))
PY
done
"$PY" -m pip index versions flash-attn 2>/dev/null | grep -q "\b$FLASH_ATTN_VERSION\b" \
  && echo "[flash-attn] $FLASH_ATTN_VERSION is on PyPI (source distribution: built against the installed torch)" \
  || { echo "[flash-attn] $FLASH_ATTN_VERSION not found on PyPI" >&2; exit 1; }
