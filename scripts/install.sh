#!/usr/bin/env bash
# Install verl_traj and everything it needs into a virtual environment (default: ./.venv).
#
#   bash scripts/install.sh                 # CPU (this project's machines, CI): runtime + test extras
#   bash scripts/install.sh --gpu vllm      # a CUDA machine: verl 0.9.1 with its vLLM pins, flash-attn, verl_traj
#   VENV=/path/to/venv bash scripts/install.sh [--gpu ...]
#
# CPU: torch==2.13.0 (CPU build) must be installed BEFORE verl: any other torch spec resolves to a multi-GB CUDA
# build.
# GPU: one path that resolves, in verl's own order (GPU.md in docs/ explains each pin):
#   1. verl at the pinned version with its rollout extra: verl[vllm]==0.9.1 pins torch 2.11.0, vllm 0.24.0 and
#      transformers 5.9.0, so pip never pulls the newest vLLM and a torch of its own. (verl 0.9.1's sglang extra
#      cannot be installed with pip: sglang 0.5.12 pins transformers==5.6.0, which verl 0.9.1 excludes; --gpu sglang
#      says so and stops);
#   2. flash-attn 2.8.3 (verl 0.9.1's pin, its `flash-attn-cu130torch211` extra), built against that torch with
#      --no-build-isolation (flash-attn ships a source distribution: an isolated build sees no torch);
#   3. verl_traj itself, with the matching extra (nothing in it changes torch).
set -euo pipefail
cd "$(dirname "$0")/.."
VERL_VERSION=0.9.1
FLASH_ATTN_VERSION=2.8.3
GPU=""
while [ $# -gt 0 ]; do
  case "$1" in
    --gpu) GPU=${2:?--gpu needs a rollout engine: vllm}; shift 2 ;;
    --gpu=*) GPU=${1#--gpu=}; shift ;;
    *) echo "[install] unknown argument '$1' (use --gpu vllm)" >&2; exit 2 ;;
  esac
done
case "$GPU" in
  ""|vllm) ;;
  sglang) echo "[install] --gpu sglang: verl 0.9.1's sglang extra does not resolve (sglang 0.5.12 pins" \
               "transformers==5.6.0, which verl 0.9.1 excludes: transformers!=5.6.0). Use --gpu vllm, or verl's" \
               "SGLang docker image with 'pip install -e .' on top." >&2; exit 2 ;;
  *) echo "[install] --gpu $GPU: use --gpu vllm (verl 0.9.1's rollout extra)" >&2; exit 2 ;;
esac
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip

if [ -n "$GPU" ]; then
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "[install] --gpu $GPU: no nvidia-smi on this machine; the GPU stack needs a CUDA driver" >&2
    exit 1
  fi
  python -m pip install -q "verl[$GPU]==$VERL_VERSION"
  python -m pip install -q --no-build-isolation "flash-attn==$FLASH_ATTN_VERSION"
  python -m pip install -q -e ".[$GPU,test,plot]"
  python -c 'import flash_attn, torch, verl, verl_traj; print(f"[install] GPU: verl {verl.__version__}, torch {torch.__version__} (CUDA {torch.version.cuda}), flash-attn {flash_attn.__version__}, verl_traj {verl_traj.__version__}")'
  exit 0
fi

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
  python -W ignore -c 'import torch; print("[install] torch", torch.__version__, "(CPU build)" if torch.version.cuda is None else "(CUDA build: no CPU wheel was found; set TORCH_WHEEL_DIR)")'
fi
python -m pip install -q -e ".[test,plot]"
python -c 'import verl, torch, verl_traj; print(f"[install] verl {verl.__version__}, torch {torch.__version__}, verl_traj {verl_traj.__version__}")'
