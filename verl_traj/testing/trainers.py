"""verl_traj's trainers without Ray or workers, for the tests and benchmarks of the planning pieces: the one builder.

The trainer is the real class (v0 ``TrajRayPPOTrainer``, or ``Traj<Name>`` of a v1 trainer class) with the attributes
its planning and update-preparation code reads; its :class:`~verl_traj.integration.update_spec.UpdateSpec` is derived
from ``config`` exactly as at start-up (without the config adaptation that needs verl's full sections).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Mapping, Optional, Union

from omegaconf import OmegaConf

__all__ = ["ray_less_trainer"]


def ray_less_trainer(config: Mapping, traj_config: Union[Mapping, Any, None] = None, *, plan: Any = None,
                     dp: Optional[int] = None, v1_class: Optional[type] = None, pad_token_id: int = 0,
                     eos_token_id: int = 2) -> Any:
    """A trainer over ``config`` (a plain mapping of verl's sections) and ``traj`` (mapping or ``TrajConfig``).

    ``plan``: the :class:`~verl_traj.integration.verl_config.PlanSettings` (None: no micro-batch cap); ``dp``: the
    data-parallel size the trainer sees (v0: ``_dp_size``; v1: the actor group's dispatch mesh); ``v1_class``: a
    registered v1 trainer class (e.g. ``PPOTrainerSync``) instead of v0's."""
    from verl_traj.config import TrajConfig
    from verl_traj.integration.update_spec import UpdateSpec

    traj_config = traj_config if isinstance(traj_config, TrajConfig) else TrajConfig.from_mapping(traj_config or {})
    if v1_class is None:
        from verl_traj.integration.trainer import TrajRayPPOTrainer

        tr = TrajRayPPOTrainer.__new__(TrajRayPPOTrainer)
        if dp is not None:
            tr._dp_size = lambda: dp
    else:
        from verl_traj.integration.v1 import traj_trainer_class

        tr = object.__new__(traj_trainer_class(v1_class))
        tr.parameter_sync_step, tr.local_trigger_step, tr.use_critic = 1, 0, False
        tr.actor_rollout_wg = SimpleNamespace(_dispatch_info={"actor": list(range(dp or 1))})
        tr._planned, tr._padding_by_key = None, {}
    tr.config = OmegaConf.create(dict(config))
    tr.traj_config = traj_config
    tr.spec = UpdateSpec.derive(tr.config, traj_config, plan) if traj_config.enable else None
    tr.tokenizer = SimpleNamespace(pad_token_id=pad_token_id, eos_token_id=eos_token_id)
    tr.global_steps = 1
    return tr
