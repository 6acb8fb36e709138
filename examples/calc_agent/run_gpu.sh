#!/usr/bin/env bash
# Calculator-agent GRPO on one GPU with vLLM (needs a machine where verl's GPU extras are installed:
#   pip install -e ".[gpu]" vllm). Model: a local path or hub id, as a hydra override, e.g.
#   bash examples/calc_agent/run_gpu.sh actor_rollout_ref.model.path=/models/Qwen2.5-1.5B-Instruct
set -euo pipefail
cd "$(dirname "$0")/../.."
python -m verl_traj.recipes.calc_agent.prepare --data-only   # the model comes from the override
exec python -m verl_traj.main_ppo --config-name calc_agent_gpu "$@"
