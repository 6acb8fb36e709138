"""Step-wise batches as verl's ``DataProto`` and a ``TrajRayPPOTrainer`` without Ray to plan them (shared by the
step-wise adapter tests and the v1 adapter tests)."""

from __future__ import annotations

import numpy as np
import torch

from verl import DataProto

from verl_traj.config import TrajConfig
from verl_traj.testing.trainers import ray_less_trainer
from verl_traj.testing import step_record_batch as make_batch, token_trajectory as make_trajectory


def stepwise_dataproto(seed=0, turn_rewards=False):
    """Four trajectories (3, 2, 4, 1 calls) in two groups; ``turn_rewards``: every LLM call but each trajectory's
    last gets a turn reward of 0.1 x (its step + 1), in its record."""
    rng = np.random.default_rng(seed)
    trajs = [make_trajectory(rng, 3), make_trajectory(rng, 2), make_trajectory(rng, 4), make_trajectory(rng, 1)]
    tensors, non = make_batch(trajs, ["g0", "g0", "g1", "g1"], [1.0, 0.0, 0.3, 0.9])
    for records in non["traj_steps"] if turn_rewards else ():
        for k, rec in enumerate(records[:-1]):
            rec["reward"] = 0.1 * (k + 1)
    return DataProto.from_dict(tensors=tensors, non_tensors=non, meta_info={"k": 1}), trajs


def stepwise_trainer(traj_config: TrajConfig, dp: int = 2, adv_estimator: str = "grpo"):
    return ray_less_trainer({"data": {"train_batch_size": 2}, "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 1}},
                             "algorithm": {"adv_estimator": adv_estimator}}, traj_config, dp=dp)


def gigpo_dataproto(seed=0):
    """Two GRPO groups of three trajectories (2-4 calls) behind their group's prompt, observations from two tokens (so
    calls of a group meet the same observation: GiGPO's shared step groups), turn rewards 0.25 x (step + 1) on all
    but the last call (exact in float32: no return ties broken by rounding). Returns ``(data, trajs, uids, outcomes)``."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    trajs, uids = [], ["g0"] * 3 + ["g1"] * 3
    for g in range(2):
        prompt = torch.randint(1, 100, (3,))
        trajs += [make_trajectory(rng, int(rng.integers(2, 5)), prompt=prompt, obs_vocab=2, min_obs=1) for _ in range(3)]
    outcomes = [1.0, 0.0, 0.5, 0.0, 1.0, 1.0]
    for records, *_ in trajs:
        for k, rec in enumerate(records[:-1]):
            rec["reward"] = 0.25 * (k + 1)
    tensors, non = make_batch(trajs, uids, outcomes, R=80)
    return DataProto.from_dict(tensors=tensors, non_tensors=non, meta_info={}), trajs, uids, outcomes


def planned_gigpo_batch(seed=0, merge=False, dp=2):
    """:func:`gigpo_dataproto` as _balance_batch leaves it for ``algorithm.adv_estimator=gigpo`` (anchor keys carried),
    with rewards; returns ``(data, trajs, uids, outcomes)``."""
    data, *rest = gigpo_dataproto(seed)
    stepwise_trainer(TrajConfig(step_wise=True, merge_prefix=merge), dp, "gigpo")._balance_batch(data, {})
    data.batch["token_level_rewards"] = data.batch["rm_scores"].clone()
    return (data, *rest)


def planned_stepwise_batch(seed=0, merge=False, dp=2, turn_rewards=False):
    """A step-wise batch as _balance_batch leaves it: expanded, planned, padded, with rewards."""
    data, trajs = stepwise_dataproto(seed, turn_rewards)
    stepwise_trainer(TrajConfig(step_wise=True, merge_prefix=merge), dp)._balance_batch(data, {})
    data.batch["token_level_rewards"] = data.batch["rm_scores"].clone()
    return data, trajs
