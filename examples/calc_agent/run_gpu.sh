#!/usr/bin/env bash
# Calculator-agent GRPO on one GPU with vLLM. Installs the GPU stack first (once; SKIP_INSTALL=1 skips it):
# verl 0.9.1 with its own vLLM pins, flash-attn built against that torch, verl_traj (scripts/install.sh --gpu,
# docs/gpu.md). Model: a local path or hub id, as a hydra override, e.g.
#   bash examples/calc_agent/run_gpu.sh actor_rollout_ref.model.path=/models/Qwen2.5-1.5B-Instruct
set -euo pipefail
cd "$(dirname "$0")/../.."
ROLLOUT=${ROLLOUT:-vllm}
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  bash scripts/install.sh --gpu "$ROLLOUT"
fi
. "${VENV:-.venv}/bin/activate"
# a GPU job: never let verl_traj's CPU platform take a process that sees no accelerator (docs/gpu.md)
export VERL_TRAJ_CPU=0
python -m verl_traj.recipes.calc_agent.prepare --data-only   # the model comes from the override
exec python -m verl_traj.main_ppo --config-name calc_agent_gpu actor_rollout_ref.rollout.name="$ROLLOUT" "$@"
