#!/usr/bin/env bash
# Calculator-agent GRPO as a multi-node Ray cluster job. One command per role:
#   on the head node:    bash examples/calc_agent/run_multinode.sh head
#   on every other node: bash examples/calc_agent/run_multinode.sh worker HEAD_IP
#   from the head node:  NNODES=2 GPUS_PER_NODE=8 bash examples/calc_agent/run_multinode.sh submit [hydra overrides]
# `submit` ships this repository (verl_traj, configs, the recipe) to every node with Ray's
# runtime environment (working_dir), so nodes only need verl installed. Recipe files are given as
# paths relative to working_dir: every Ray worker of the job runs there, on every node.
set -euo pipefail
cd "$(dirname "$0")/../.."
role=${1:?usage: run_multinode.sh head | worker HEAD_IP | submit [overrides]}
shift
PORT=${RAY_PORT:-6379}
case "$role" in
  head)   exec ray start --head --port="$PORT" --dashboard-host=0.0.0.0 ;;
  worker) exec ray start --address="${1:?HEAD_IP}:$PORT" ;;
  submit)
    # data inside the shipped working_dir (./artifacts), so the task runner finds it on any node
    VERL_TRAJ_HOME=$PWD/artifacts python examples/calc_agent/prepare.py --data-only
    exec ray job submit --address="http://127.0.0.1:${RAY_DASHBOARD_PORT:-8265}" \
      --runtime-env-json="{\"working_dir\": \"$PWD\", \"excludes\": [\".venv\", \".git\", \"docs\"], \"env_vars\": {\"VERL_TRAJ_HOME\": \"artifacts\"}}" \
      -- python -m verl_traj.main_ppo --config-name calc_agent_gpu \
      trainer.nnodes="${NNODES:-2}" trainer.n_gpus_per_node="${GPUS_PER_NODE:-8}" \
      actor_rollout_ref.rollout.multi_turn.function_tool_path=examples/calc_agent/calc_tool.py \
      reward.custom_reward_function.path=examples/calc_agent/task.py "$@" ;;
  *) echo "unknown role '$role': use head, worker HEAD_IP or submit" >&2; exit 2 ;;
esac
