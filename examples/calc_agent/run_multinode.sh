#!/usr/bin/env bash
# Calculator-agent GRPO as a multi-node Ray cluster job. One command per role:
#   on the head node:    bash examples/calc_agent/run_multinode.sh head
#   on every other node: bash examples/calc_agent/run_multinode.sh worker HEAD_IP
#   from the head node:  NNODES=2 GPUS_PER_NODE=8 bash examples/calc_agent/run_multinode.sh submit [hydra overrides]
# `head` and `worker` install the GPU stack first (scripts/install.sh --gpu $ROLLOUT, default vllm; SKIP_INSTALL=1
# skips it) and start Ray with VERL_TRAJ_CPU=0, so no process of the job takes verl_traj's CPU platform (a CPU-only
# head node included; docs/gpu.md). `submit` ships this repository (verl_traj, configs, the recipe) to every node
# with Ray's runtime environment (working_dir). Recipe files are given as paths relative
# to working_dir: every Ray worker of the job runs there, on every node.
#
# Security: Ray's dashboard serves a job-submission API that runs arbitrary code without authentication.
# It binds to 127.0.0.1 here (the default): `submit` runs on the head node, and from elsewhere you reach it
# through an SSH tunnel (ssh -L 8265:127.0.0.1:8265 HEAD). RAY_DASHBOARD_HOST=0.0.0.0 opens it to the whole
# network: only on a network where every host is trusted (Ray's security guidance: never expose Ray's ports
# to untrusted networks; firewall the GCS port $RAY_PORT to the cluster's own nodes too).
# DRY_RUN=1 prints the commands instead of running them.
set -euo pipefail
cd "$(dirname "$0")/../.."
role=${1:?usage: run_multinode.sh head | worker HEAD_IP | submit [overrides]}
shift
PORT=${RAY_PORT:-6379}
DASHBOARD_HOST=${RAY_DASHBOARD_HOST:-127.0.0.1}
ROLLOUT=${ROLLOUT:-vllm}
run() { if [ "${DRY_RUN:-0}" = 1 ]; then echo "$@"; else exec "$@"; fi; }
install() {
  if [ "${SKIP_INSTALL:-0}" = 1 ]; then return; fi
  if [ "${DRY_RUN:-0}" = 1 ]; then echo bash scripts/install.sh --gpu "$ROLLOUT"; else bash scripts/install.sh --gpu "$ROLLOUT"; fi
}
case "$role" in
  head)
    case "$DASHBOARD_HOST" in
      127.0.0.1|localhost|::1) ;;
      *) echo "WARNING: RAY_DASHBOARD_HOST=$DASHBOARD_HOST exposes Ray's dashboard and its unauthenticated" \
              "job-submission API (arbitrary code execution) to every host that can reach $DASHBOARD_HOST." \
              "Use it only on a trusted network; prefer the default 127.0.0.1 with an SSH tunnel." >&2 ;;
    esac
    install
    run env VERL_TRAJ_CPU=0 ray start --head --port="$PORT" --dashboard-host="$DASHBOARD_HOST" ;;
  worker)
    install
    run env VERL_TRAJ_CPU=0 ray start --address="${1:?HEAD_IP}:$PORT" ;;
  submit)
    # data inside the shipped working_dir (./artifacts), so the task runner finds it on any node
    if [ "${DRY_RUN:-0}" != 1 ]; then
      VERL_TRAJ_HOME=$PWD/artifacts python -m verl_traj.recipes.calc_agent.prepare --data-only
    fi
    run ray job submit --address="http://127.0.0.1:${RAY_DASHBOARD_PORT:-8265}" \
      --runtime-env-json="{\"working_dir\": \"$PWD\", \"excludes\": [\".venv\", \".git\", \"docs\"], \"env_vars\": {\"VERL_TRAJ_HOME\": \"artifacts\", \"VERL_TRAJ_CPU\": \"0\"}}" \
      -- python -m verl_traj.main_ppo --config-name calc_agent_gpu \
      trainer.nnodes="${NNODES:-2}" trainer.n_gpus_per_node="${GPUS_PER_NODE:-8}" \
      actor_rollout_ref.rollout.multi_turn.function_tool_path=verl_traj/recipes/calc_agent/tool.py \
      reward.custom_reward_function.path=pkg://verl_traj.recipes.calc_agent.task "$@" ;;
  *) echo "unknown role '$role': use head, worker HEAD_IP or submit" >&2; exit 2 ;;
esac
