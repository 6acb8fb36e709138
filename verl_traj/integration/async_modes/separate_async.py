"""verl's ``separate_async`` trainer mode at start-up: its one batch rule, stated in verl's terms.

verl 0.9.1's ``PPOTrainerSeparateAsync`` runs ``parameter_sync_step`` local updates between weight syncs, each of
exactly one mini-batch, and asserts ``data.train_batch_size == trainer.v1.separate_async.parameter_sync_step x
actor_rollout_ref.actor.ppo_mini_batch_size`` when the trainer is built (after Ray and the workers have started).
:func:`settle_parameter_sync_step` checks that rule on the driver before anything starts, with the values and the
fix; ``parameter_sync_step: null`` (the CPU presets' value, ``configs/platform/cpu.yaml``) means "the one value
verl's rule allows", ``train_batch_size / ppo_mini_batch_size``, written into the config.
"""

from __future__ import annotations

from typing import Any, Optional

from omegaconf import open_dict

from verl_traj.config import TrajConfigError
from verl_traj.integration.config.access import flag_at, int_at, value_at

__all__ = ["SYNC_STEP", "is_separate_async", "settle_parameter_sync_step"]

SYNC_STEP = "trainer.v1.separate_async.parameter_sync_step"
TRAIN_BS, MINI_BS = "data.train_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size"


def is_separate_async(config: Any) -> bool:
    """The v1 trainer in verl's ``separate_async`` mode (a standalone rollout pool)."""
    return flag_at(config, "trainer.use_v1", False) and value_at(config, "trainer.v1.trainer_mode") == "separate_async"


def settle_parameter_sync_step(config: Any) -> Optional[str]:
    """In ``separate_async``: fill a null ``parameter_sync_step`` with ``train_batch_size / ppo_mini_batch_size`` and
    check verl's rule; returns the setting written (``"field=value"``) or None. Raises :class:`TrajConfigError`
    naming the three values and the fix where the rule cannot hold."""
    if not is_separate_async(config):
        return None
    train_bs, mini = int_at(config, TRAIN_BS, 0, minimum=1), int_at(config, MINI_BS, 0, minimum=1)
    if value_at(config, SYNC_STEP) is None:
        if train_bs % mini:
            raise TrajConfigError(
                f"{SYNC_STEP}=null asks for the sync step verl's separate_async allows, {TRAIN_BS} / {MINI_BS}, "
                f"but {TRAIN_BS}={train_bs} is not a multiple of {MINI_BS}={mini}: verl runs parameter_sync_step "
                f"local updates of exactly one mini-batch between weight syncs. Fix: make {TRAIN_BS} a multiple of "
                f"{mini} (e.g. {mini * max(train_bs // mini, 1)}).", field=TRAIN_BS)
        with open_dict(config):
            config.trainer.v1.separate_async.parameter_sync_step = train_bs // mini
        return f"{SYNC_STEP}={train_bs // mini}"
    sync = int_at(config, SYNC_STEP, 1, minimum=1)
    if train_bs != sync * mini:
        fix = (f"set {SYNC_STEP}={train_bs // mini} (or null: the CPU presets derive it)" if train_bs % mini == 0
               else f"set {TRAIN_BS}={sync * mini}")
        raise TrajConfigError(
            f"verl's separate_async trainer needs {TRAIN_BS} == {SYNC_STEP} x {MINI_BS} (each of the "
            f"parameter_sync_step local updates between weight syncs is exactly one mini-batch), but {TRAIN_BS}="
            f"{train_bs}, {SYNC_STEP}={sync} and {MINI_BS}={mini} give {train_bs} != {sync * mini}. Fix: {fix}.",
            field=SYNC_STEP)
    return None
