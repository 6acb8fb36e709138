#!/usr/bin/env bash
# Quick start on any machine (no GPU needed): install, then train the multi-turn calculator agent with
# step-wise rows and prefix merging for a few steps, and print what verl_traj did.
#
#   bash scripts/quickstart.sh                                    # prepare (once) + 15 steps + summary + plot
#   bash scripts/quickstart.sh trainer.total_training_steps=20    # extra arguments: hydra overrides
#
# The fastest smoke run (single-turn tiny task, 2-3 minutes with start-up): python -m verl_traj.cpu.build_tiny, then
# python -m verl_traj.main_ppo --config-name cpu_tiny
# Outputs: $VERL_TRAJ_OUT (default ./verl_traj_quickstart): metrics.jsonl, run.png, train.log.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. "${VENV:-.venv}/bin/activate"
exec python -m verl_traj.quickstart "$@"
