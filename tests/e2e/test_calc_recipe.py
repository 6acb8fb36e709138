"""The calculator-agent recipe's CPU path end to end, as CI runs it: offline preparation (data, tiny
model, short warm start: the ``recipe_home`` fixture), then real GRPO steps through ``verl_traj.main_ppo
--config-name calc_agent_cpu``: verl's tool_agent loop calling the calculator, the recipe's reward, verl_traj's
planner and workers. The quick start (the same task with step-wise rows) runs from the installed wheel:
``test_packaging.py``."""

import pytest

pytestmark = pytest.mark.e2e
STEPS = 2


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

