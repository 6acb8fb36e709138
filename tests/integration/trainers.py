"""The trainer-unit and padding-consumer tests' preset of :func:`verl_traj.testing.trainers.ray_less_trainer`."""

from __future__ import annotations

from verl_traj.integration.config.verl_config import PlanSettings
from verl_traj.testing.trainers import ray_less_trainer

P, R_ = 5, 6  # prompt and response widths of the shared test batches


def fake_trainer(traj_config: "dict | None" = None, train_batch_size=4, mini=2, epochs=1, cap=(P + R_) * 4,
                 dp=None, n=1):
    config = {"data": {"train_batch_size": train_batch_size, "max_prompt_length": P, "max_response_length": R_},
              "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": mini, "ppo_epochs": epochs,
                                              "loss_agg_mode": "token-mean"}, "rollout": {"n": n}}}
    return ray_less_trainer(config, traj_config, plan=PlanSettings(cap, "tokens", True), dp=dp)
