"""``algorithm.adv_estimator=gigpo`` inside verl: the name in verl's estimator registry, and the advantage of a
planned step-row batch (both trainers: v0's ``compute_advantage`` patch and v1's ``planned_advantage`` reach it
through :func:`~verl_traj.integration.rows.stepwise_rows.stepwise_advantage`).

The step rows carry each LLM call's anchor key (``step_anchors``, ``[B, R]``): v0's expansion writes it, v1's
agent-loop worker tags each row with its calls' keys (:data:`~verl_traj.core.rollout.row_tags.STEP_ANCHOR_TAG`) and the plan's
facts put them back on their tokens. :func:`gigpo_advantage` then runs
:func:`verl_traj.stepwise.step_groups.gigpo_advantages` with verl's GRPO as the episode-level estimator. Its metrics
(``traj_gigpo/*``) travel in the batch's ``meta_info`` (:data:`ADVANTAGE_METRICS`) to the step's metrics.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch

from verl.trainer.ppo import core_algos

from verl_traj.core.errors import TrajInputError
from verl_traj.core.plan.estimators import estimator_name, estimator_traits
from verl_traj.core.keys import ADVANTAGE_METRICS, IS_LAST_STEP, STEP_ANCHORS, TRAJ_INDEX
from verl_traj.stepwise.advantages import last_step_rows, run_outcome_estimator
from verl_traj.stepwise.step_groups import StepGroupOptions, gigpo_advantages

__all__ = ["ADVANTAGE_METRICS", "GIGPO", "gigpo_advantage", "register_gigpo", "uses_step_groups"]

GIGPO = "gigpo"


def _outside_step_rows(token_level_rewards: Any = None, response_mask: Any = None, index: Any = None,
                       **kwargs: Any) -> Any:
    """What verl's registry runs for ``gigpo`` on a batch without step rows: a refusal, never a silent GRPO."""
    raise TrajInputError(
        "algorithm.adv_estimator='gigpo' reached verl's own advantage path, on a batch without step rows: GiGPO groups "
        "each LLM call with the calls of its GRPO group that saw the same observation, so it needs one row per call. "
        "Fix: set traj.enable=true and traj.step_wise=true with a step-recording agent loop (docs/agent_loops.md), "
        "or another estimator (grpo).", field="algorithm.adv_estimator")


def register_gigpo() -> None:
    """Put ``gigpo`` in verl's estimator registry (idempotent): verl's config and start-up checks accept the name,
    and a batch that reaches verl's own path with it is refused."""
    if core_algos.ADV_ESTIMATOR_REGISTRY.get(GIGPO) is not _outside_step_rows:
        core_algos.register_adv_est(GIGPO)(_outside_step_rows)


def uses_step_groups(adv_estimator: Any) -> bool:
    """The estimator reads each call's anchor key (the step rows must carry them)."""
    return estimator_traits(estimator_name(adv_estimator)).step_groups


def gigpo_advantage(data: Any, rewards: torch.Tensor, steps: Any, uid: np.ndarray, *, gamma: float,
                    episode: tuple[Callable, dict], options: Optional[StepGroupOptions]) -> None:
    """GiGPO's advantages of a planned step-row batch (verl ``DataProto``), in place: ``advantages`` and ``returns``
    (= advantages, as verl's GRPO), metrics under ``meta_info[ADVANTAGE_METRICS]``.

    ``rewards``: ``[B, R]`` token rewards with the turn rewards on their tokens; ``steps``: ``[B]`` each row's step;
    ``uid``: ``[B]`` GRPO ids; ``episode``: verl's GRPO and the keyword arguments it accepts (its normalisation);
    ``options``: the ``traj:`` knobs (required: a caller that did not wire them is an error, not a default)."""
    if options is None:
        raise RuntimeError("gigpo_advantage needs the traj: section's StepGroupOptions (the caller did not pass them)")
    td = data.batch
    if STEP_ANCHORS not in td.keys():
        raise TrajInputError(
            f"batch[{STEP_ANCHORS!r}] is missing: GiGPO needs each LLM call's anchor key, which the step rows carry "
            "when algorithm.adv_estimator=gigpo at rollout. Fix: keep the field through the batch (a custom "
            "expansion must pass step_anchors=True to expand_step_rows).", field=STEP_ANCHORS)
    fn, kwargs = episode

    def episode_fn(scores: torch.Tensor, traj_uid: np.ndarray) -> torch.Tensor:
        return run_outcome_estimator(fn, scores, traj_uid, estimator_name="grpo", estimator_kwargs=kwargs)[0]

    norm = bool(kwargs.get("norm_adv_by_std_in_grpo", True))
    last = last_step_rows(td[TRAJ_INDEX].cpu(), data.non_tensor_batch[IS_LAST_STEP])  # one row per trajectory
    advantages, metrics = gigpo_advantages(
        rewards, td["response_mask"], td[TRAJ_INDEX], steps, td[STEP_ANCHORS],
        np.asarray(uid, dtype=object)[last.numpy()], episode_fn, gamma=gamma, weight=options.weight,
        baseline=options.baseline, norm_by_std=norm)
    td["advantages"] = advantages.to(td["response_mask"].device)
    td["returns"] = td["advantages"].clone()
    del td[STEP_ANCHORS]  # read once: the update does not need it
    data.meta_info[ADVANTAGE_METRICS] = metrics


register_gigpo()  # verl's extension point, as its own estimators register at import
