#!/usr/bin/env bash
# Quickstart on any machine (no GPU needed): install, build the tiny offline model/data, train.
#
#   bash scripts/quickstart.sh                       # 5 GRPO steps of cpu_tiny, verl's console metrics
#   bash scripts/quickstart.sh trainer.total_training_steps=60 'trainer.logger=[console,file]'
#
# Artifacts: $VERL_TRAJ_HOME (default ~/.cache/verl_traj/tiny), built only if missing.
# With trainer.logger containing "file", metrics go to $VERL_FILE_LOGGER_PATH
# (default ./verl_traj_cpu_metrics.jsonl); plot them with scripts/plot_reward.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. "${VENV:-.venv}/bin/activate"
export VERL_TRAJ_HOME=${VERL_TRAJ_HOME:-$HOME/.cache/verl_traj/tiny}
export VERL_FILE_LOGGER_PATH=${VERL_FILE_LOGGER_PATH:-$PWD/verl_traj_cpu_metrics.jsonl}
python -m verl_traj.cpu.build_tiny --home "$VERL_TRAJ_HOME"
python -m verl_traj.main_ppo --config-name cpu_tiny "$@"
