"""The calculator-agent recipe's CPU path end to end, as CI runs it: offline preparation (data, tiny
model, short warm start), then real GRPO steps through ``verl_traj.main_ppo --config-name
calc_agent_cpu``: verl's tool_agent loop calling the calculator, the recipe's reward, verl_traj's
planner and workers."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e
STEPS = 2


@pytest.fixture(scope="module")
def recipe_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("calc_recipe")
    # a short warm start is enough to make the tool-call format likely; the long one is the recipe's.
    # --eval-samples 4 still runs prepare's offline evaluation (evaluate.py) on the warm-started model
    cmd = [sys.executable, "-m", "verl_traj.recipes.calc_agent.prepare", "--home", str(home / "calc_agent"),
           "--sft-steps", "80", "--n-train", "64", "--n-test", "8", "--eval-samples", "4"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    return home


def test_calc_agent_recipe_trains_on_cpu(run_training, recipe_home):
    run = run_training(
        # half the recipe's batch keeps CI short; its mini-batch size and epochs are the recipe's
        [f"trainer.total_training_steps={STEPS}", "actor_rollout_ref.rollout.temperature=0.7",
         "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4"],
        timeout=600,
        config_name="calc_agent_cpu",
        extra_env={"VERL_TRAJ_HOME": str(recipe_home)},
    )
    assert run.returncode == 0, run.tail(120)
    assert len(run.metrics) == STEPS, run.tail(60)
    for m in run.metrics:
        # the tool loop really ran: assistant + tool turns beyond a single reply (user + assistant = 2)
        assert m["num_turns/mean"] > 2.0 and m["num_turns/max"] >= 4, m
        # the recipe's reward is bounded: 1.0 correct, else 0.1 * answer tag + 0.5 * call progress
        assert 0.0 <= m["critic/score/min"] and m["critic/score/max"] <= 1.0
        # verl_traj: groups whole, the configured optimizer steps (train_batch_size 8 / mini 4, 2 epochs)
        assert m["traj_plan/split_groups"] == 0 and m["traj_plan/split_trajectories"] == 0
        assert m["actor/num_optimizer_steps"] == 4
        assert m["actor/grad_norm"] > 0


def test_quickstart_runs_the_multi_turn_agent_with_step_rows(recipe_home, tmp_path):
    """``python -m verl_traj.quickstart`` (the README's first command, after install): the prepared recipe, step-wise
    rows with prefix merging, and a summary of what verl_traj did."""
    import os

    env = dict(os.environ, VERL_TRAJ_HOME=str(recipe_home), VERL_TRAJ_OUT=str(tmp_path / "out"),
               VERL_TRAJ_CKPT_DIR=str(tmp_path / "ckpt"))
    run = subprocess.run([sys.executable, "-m", "verl_traj.quickstart", f"trainer.total_training_steps={STEPS}",
                          "actor_rollout_ref.rollout.temperature=0.7"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=900)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    summary = out[out.index("verl_traj summary"):]
    assert f"{STEPS} training steps" in summary and "every one kept whole in one mini-batch" in summary
    assert "LLM calls became" in summary and "by prefix merging" in summary
    assert "optimizer steps per training step: [2] (as configured" in summary
    assert (tmp_path / "out" / "run.png").exists()
    metrics = [json.loads(line)["data"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    assert len(metrics) == STEPS
    for m in metrics:
        # step rows, prefix-merged on the v1 agent-loop worker, reproduce what the rollout generated token for token
        assert m["training/rollout_probs_diff_max"] < 1e-4
        assert m["traj_stepwise/rows_after"] <= m["traj_stepwise/rows_before"]
        assert m["traj_stepwise/tokens_after"] <= m["traj_stepwise/tokens_before"]
        assert m["traj_plan/real_rows"] == m["traj_stepwise/rows_after"]
        assert m["traj_stepwise/loss_tokens"] == m["traj_plan/loss_tokens"]
        assert m["traj_plan/split_trajectories"] == 0 and m["traj_plan/split_groups"] == 0
    assert any(m["traj_stepwise/rows_after"] < m["traj_stepwise/rows_before"] for m in metrics)  # merging happened
