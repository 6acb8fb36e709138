#!/usr/bin/env bash
# Calculator-agent GRPO on CPU, one command: install, prepare offline (data, tiny model, warm start),
# train. Extra arguments are hydra overrides, e.g. trainer.total_training_steps=80.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/install.sh
. "${VENV:-.venv}/bin/activate"
python -m verl_traj.recipes.calc_agent.prepare
exec python -m verl_traj.main_ppo --config-name calc_agent_cpu "$@"
