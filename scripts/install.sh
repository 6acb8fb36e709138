#!/usr/bin/env bash
# Install verl_traj and everything it needs into a virtual environment (default: ./.venv).
#
#   bash scripts/install.sh            # runtime + test extras
#   VENV=/path/to/venv bash scripts/install.sh
#
# On a machine without CUDA, torch==2.13.0 (CPU build) must be installed BEFORE verl: any other
# torch spec resolves to a multi-GB CUDA build. With CUDA present, the torch already in the
# environment (or the one verl resolves) is kept. flash-attn is only in the optional `gpu` extra.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1; then
  if ! python -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
    echo "[install] no CUDA driver found: installing the CPU build torch==2.13.0 first"
    # The CPU wheel is served from a local wheel directory (TORCH_WHEEL_DIR, default /opt/wheels, where
    # this project's machines keep it); name it explicitly so a stripped pip config still finds it.
    # Without it, PyPI's torch==2.13.0 is the multi-GB CUDA build (it runs on CPU, but is slow to fetch).
    wheels=${TORCH_WHEEL_DIR:-/opt/wheels}
    if [ -d "$wheels" ]; then
      python -m pip install -q --find-links "$wheels" "torch==2.13.0"
    else
      python -m pip install -q "torch==2.13.0"
    fi
  fi
  python -c 'import torch; print("[install] torch", torch.__version__, "(CPU build)" if torch.version.cuda is None else "(CUDA build: no CPU wheel was found; set TORCH_WHEEL_DIR)")'
fi
python -m pip install -q -e ".[test,plot]"
python -c 'import verl, torch, verl_traj; print(f"[install] verl {verl.__version__}, torch {torch.__version__}, verl_traj {verl_traj.__version__}")'
