"""verl_traj's trainer: verl's ``RayPPOTrainer`` with trajectory-aware batching."""

from __future__ import annotations

from verl.trainer.ppo.ray_trainer import RayPPOTrainer


class TrajRayPPOTrainer(RayPPOTrainer):
    """Placeholder until the trajectory-aware ``_balance_batch`` lands: stock behaviour."""
