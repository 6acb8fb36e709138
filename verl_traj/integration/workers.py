"""verl_traj's actor and critic workers (thin subclasses of verl's engine workers)."""

from __future__ import annotations

from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker


class TrajCriticWorker(TrainingWorker):
    """Placeholder until mini-batch-id aware training lands: stock behaviour."""


class TrajActorRolloutRefWorker(ActorRolloutRefWorker):
    """Placeholder until mini-batch-id aware training lands: stock behaviour."""
