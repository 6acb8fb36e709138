"""docs/agent_loops.md's example, as a user runs it: a plain verl ``AgentLoopBase`` of their own
(``examples/own_agent_loop/guess_loop.py``: a digit-guessing game, the environment's answers appended between calls)
made step-wise by one mixin, with its own reward function and a turn reward per call, trained through
``python -m verl_traj.main_ppo`` with the yaml and overrides the page gives."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.e2e.runs import launch, tail

pytestmark = pytest.mark.e2e
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_agent_loop"


def test_own_agent_loop_example_trains_on_step_rows(tiny_home, tmp_path):
    pythonpath = os.pathsep.join(filter(None, [str(EXAMPLE), os.environ.get("PYTHONPATH")]))
    run = launch(tiny_home, tmp_path, [
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={EXAMPLE / 'agent_loops.yaml'}",
        "actor_rollout_ref.rollout.agent.default_agent_loop=guess_digit", "traj.step_wise=true",
        "data.max_response_length=64", f"reward.custom_reward_function.path={EXAMPLE / 'reward.py'}",
        "trainer.total_training_steps=2"], extra_env={"PYTHONPATH": pythonpath})
    assert run.returncode == 0, tail(run.output, 80)
    assert len(run.metrics) == 2, tail(run.output, 40)
    for m in run.metrics:
        trajectories = m["traj_stepwise/trajectories"]
        assert m["traj_stepwise/rows_before"] > trajectories  # several LLM calls per trajectory, each recorded
        assert m["traj_stepwise/rows_after"] == trajectories  # the loop appends to its context: one row each
        assert 0 < m["traj_stepwise/turn_rewards_nonzero"] <= m["traj_stepwise/rows_before"]
        assert m["traj_stepwise/turn_reward_sum"] == pytest.approx(0.1 * m["traj_stepwise/turn_rewards_nonzero"])
        assert m["training/rollout_probs_diff_max"] < 1e-5  # each row's tokens are the calls' own, in order
        assert m["traj_plan/split_groups"] == 0
