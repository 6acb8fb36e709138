"""A ``TrajRayPPOTrainer`` without Ray or workers, for the trainer's planning pieces (shared by the trainer-unit
and padding-consumer tests)."""

from __future__ import annotations

from omegaconf import OmegaConf

from verl_traj.config import TrajConfig
from verl_traj.integration import trainer as T
from verl_traj.integration.verl_config import PlanSettings

P, R_ = 5, 6  # prompt and response widths of the shared test batches


def fake_trainer(traj: "dict | None" = None, train_batch_size=4, mini=2, epochs=1, cap=(P + R_) * 4):
    tr = T.TrajRayPPOTrainer.__new__(T.TrajRayPPOTrainer)
    tr.traj = TrajConfig.from_mapping(traj or {})
    tr.plan_settings = PlanSettings(cap, "tokens", True)
    tr.config = OmegaConf.create(
        {
            "data": {"train_batch_size": train_batch_size, "max_prompt_length": P, "max_response_length": R_},
            "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": mini, "ppo_epochs": epochs,
                                            "loss_agg_mode": "token-mean"}},
        }
    )
    tr.tokenizer = None
    tr.global_steps = 1
    return tr
