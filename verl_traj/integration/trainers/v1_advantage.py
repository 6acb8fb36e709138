"""The planned advantage on verl's v1 trainer: what verl's ``_compute_advantage`` computes for a planned batch.

The chain, from the trainer step (three hops to the estimator):

1. ``TrajV1Mixin._compute_advantage`` (:mod:`verl_traj.integration.trainers.v1`) runs verl's own ``_compute_advantage``
   (``trainer/ppo/v1/trainer_base.py``: fetch the fields from TransferQueue, KL-in-reward, rollout correction, the
   advantage, write back) with its global ``compute_advantage_for_multi_trajectories`` replaced for that call by
   :func:`planned_advantage` of the batch's :class:`~verl_traj.integration.trainers.v1_plan_facts.PlanFacts`, its
   ``apply_kl_penalty`` (imported by name from ``ray_trainer``: v0's patch does not reach it) by
   :func:`kl_penalty_on_planned_rows` (and, for step rows at ``traj.ratio_scope=trajectory``, its rollout correction
   by :func:`corrected_per_trajectory`);
2. :func:`planned_advantage` (here) attaches the plan's facts, records the final loss tokens and calls the
   estimator on the real rows (:func:`~verl_traj.integration.rows.real_rows.advantage_on_real_rows`);
3. the estimator: verl's ``compute_advantage``, or for step rows
   :func:`~verl_traj.integration.rows.stepwise_rows.stepwise_advantage` (an outcome estimator once per trajectory, a
   temporal one on each trajectory's :class:`~verl_traj.stepwise.timeline.Timeline` of rows).

v1 copies a trajectory's reward onto every step row; :func:`planned_advantage` counts it once, on the last step.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from verl.trainer.ppo import ray_trainer

from verl_traj.core.keys import ADVANTAGE_METRICS, ADVANTAGES_NEGATIVE, PATH_COPIES
from verl_traj.integration.rows.real_rows import advantage_on_real_rows, kl_penalty_on_real_rows
from verl_traj.integration.rows.stepwise_rows import stepwise_advantage, trajectory_scoped_correction
from verl_traj.integration.trainers.v1_plan_facts import STEP_INDEX, PlanFacts
from verl_traj.stepwise.step_groups import StepGroupOptions

__all__ = ["PutWithTreeParts", "corrected_per_trajectory", "kl_penalty_on_planned_rows", "planned_advantage"]


def _count_reward_once(data: Any, facts: PlanFacts) -> None:
    """``token_level_rewards`` keep the score on each trajectory's last step only (v1 puts it on every step row;
    KL penalties from KL-in-reward stay on every row)."""
    td = data.batch
    not_last = (~facts.is_last_step).to(device=td.device, dtype=td["token_level_scores"].dtype)
    td["token_level_rewards"] = td["token_level_rewards"] - td["token_level_scores"] * not_last[:, None]


def planned_advantage(facts: PlanFacts, data: Any, batch_keys: list[str], adv_estimator: Any, gamma: float = 1.0,
                      lam: float = 1.0, num_repeat: int = 1, norm_adv_by_std_in_grpo: bool = True,
                      config: Optional[Any] = None, *, step_groups: Optional[StepGroupOptions] = None,
                      hand_on: Callable[[PlanFacts], None]) -> Any:
    """v1's ``compute_advantage_for_multi_trajectories(data, batch_keys, adv_estimator, ...)`` for a planned batch
    (``facts`` bound first; ``data``: verl's ``DataProto`` of ``[B, R]`` fields in ``batch_keys`` order).

    Padding rows get zeros and move nothing. A batch whose trajectories have several rows (steps), or turn rewards,
    counts the reward once, on its last step, plus the turn rewards on their tokens, then runs the step-wise
    advantage (outcome estimators once per trajectory, each row getting the trajectory's scalar on its own tokens;
    temporal ones on each trajectory's timeline of rows); otherwise verl's ``compute_advantage`` runs on the real
    rows, as on v0. ``hand_on`` receives the facts after the step, a new value: each row's final loss tokens (after
    verl's rollout correction) and the advantage step's metrics (``gigpo``: ``traj_gigpo/*``; ``step_groups``: its
    ``traj:`` knobs, bound by the trainer)."""
    facts.attach(data, batch_keys)
    final = facts.with_final_loss_tokens(data.batch["response_mask"])  # the correction ran before this step
    kwargs = dict(gamma=gamma, lam=lam, num_repeat=num_repeat, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
                  config=config)
    if not facts.stepwise:
        out = advantage_on_real_rows(ray_trainer.compute_advantage)(data, adv_estimator, **kwargs)
    else:
        _count_reward_once(data, facts)
        estimator = stepwise_advantage(ray_trainer.compute_advantage, step_index_key=STEP_INDEX,
                                       step_groups=step_groups)
        out = advantage_on_real_rows(estimator)(data, adv_estimator, **kwargs)
    td = out.batch
    parts = [td[k] if k in td.keys() else None for k in (ADVANTAGES_NEGATIVE, PATH_COPIES)]
    final = final.with_tree_parts(*parts, td["response_mask"])
    hand_on(final.with_advantage_metrics(data.meta_info.pop(ADVANTAGE_METRICS, {})))
    return out


class PutWithTreeParts:
    """verl's ``transfer_queue`` module as ``trainer_base`` sees it during one ``_compute_advantage``, except that the
    put of the advantages also puts a branching session's parts in the same call, nested as the advantages are: the
    two-sign part (:data:`~verl_traj.core.keys.ADVANTAGES_NEGATIVE`) and the path copies
    (:data:`~verl_traj.core.keys.PATH_COPIES`), which the actor's loss reads (``workers.losses``). ``facts()``: the
    step's :class:`~verl_traj.integration.trainers.v1_plan_facts.PlanFacts`, read when the put happens (after the
    advantage handed them on)."""

    def __init__(self, tq: Any, facts: Callable[[], Any]) -> None:
        self._tq, self._facts = tq, facts

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tq, name)

    def kv_batch_put(self, *args: Any, fields: Any = None, **kwargs: Any) -> Any:
        facts = self._facts()
        if fields is not None and "advantages" in fields.keys():
            offsets = fields["advantages"].offsets().cpu()  # nested [B, j]: each row's response positions
            for name, part in ((ADVANTAGES_NEGATIVE, facts.advantages_negative), (PATH_COPIES, facts.path_copies)):
                if part is not None:  # [B, R], R the widest response: each row's first j positions, in row order
                    keep = torch.arange(part.shape[1]) < offsets.diff()[:, None]
                    fields[name] = torch.nested.nested_tensor_from_jagged(
                        part.cpu()[keep].to(fields["advantages"].dtype), offsets=offsets)
        return self._tq.kv_batch_put(*args, fields=fields, **kwargs)


def corrected_per_trajectory(facts: PlanFacts, verl_add_to_batch: Callable, data: Any,
                             rollout_corr_config: Any) -> tuple[Any, dict]:
    """v1's ``compute_rollout_correction_and_add_to_batch(data, rollout_corr_config)`` for a planned batch
    (``facts`` and verl's function bound first): the facts attached (v1 corrects before it computes advantages),
    then verl's correction per trajectory
    (:func:`~verl_traj.integration.rows.stepwise_rows.trajectory_scoped_correction`). Returns ``(data, metrics)`` as
    verl's does."""
    facts.attach(data, list(facts.keys))  # the trainer checked the batch's keys
    return trajectory_scoped_correction(verl_add_to_batch, step_index_key=STEP_INDEX)(data, rollout_corr_config)


def kl_penalty_on_planned_rows(facts: PlanFacts, verl_apply_kl_penalty: Callable, data: Any, *args: Any,
                               **kwargs: Any) -> tuple[Any, dict]:
    """v1's ``apply_kl_penalty(data, kl_ctrl, kl_penalty)`` for a planned batch (``facts`` and verl's function bound
    first; ``data``: verl's ``DataProto`` of ``[B, R]`` fields, dispatch order): the facts attached (v1 builds it from
    a fixed field list, without the padding flag), then v0's
    :func:`~verl_traj.integration.rows.real_rows.kl_penalty_on_real_rows`: the KL statistics
    (``actor/reward_kl_penalty``) and the adaptive controller's update see the real rows (their mean KL, their
    count); padding rows keep their (zero) scores as rewards. Returns ``(data, metrics)`` as verl's does."""
    facts.attach(data, list(facts.keys))
    return kl_penalty_on_real_rows(verl_apply_kl_penalty)(data, *args, **kwargs)
