"""Outcome advantages for step-wise multi-turn rows: per trajectory, then broadcast to every step.

With step-wise rows (one row per LLM call) a trajectory of N turns is N rows that share ONE outcome.
Running a GRPO-style estimator over rows is wrong twice over: every step row would be a group member
(a 40-turn trajectory would count 40 times in its group's mean/std), and copying an advantage that
was computed on the last row's ``response_mask`` onto earlier rows puts it on the wrong token
positions (SkyRL issue 1492: rows are right-padded to different lengths, so the last row's mask
says nothing about where an earlier row's response tokens are).

The fix (same idea as SkyRL PR 1507):

1. one scalar score per trajectory (by default: the reward on its last-step row);
2. the registered outcome estimator runs ONCE over trajectories (``[T, 1]`` rewards and an
   all-ones ``[T, 1]`` mask, grouped by the trajectory's GRPO ``uid``) -> one scalar per trajectory;
3. ``broadcast_step_advantages`` puts that scalar on every step row, multiplied by the row's OWN
   ``response_mask`` (so each step gets it at its own token positions, and padding/observation
   tokens get 0).

Trajectories are numbered once, by the core's layout; the plan carries that dense ``traj_index`` in
the batch and this module reads it (it never re-derives trajectories from string ids).

Pure module: torch, numpy and stdlib only. verl's estimator is passed in as a callable
(``verl.trainer.ppo.core_algos.get_adv_estimator_fn(name)``), so nothing here imports verl.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch

from verl_traj.core.errors import check_finite, check_index
from verl_traj.core.plan.estimators import ESTIMATORS, estimator_traits, step_row_refusal
from verl_traj.core.plan.estimators import estimator_name as name_of
from verl_traj.stepwise.inputs import (StepwiseAdvantageError, check_per_row, check_per_trajectory, checked_flags,
                                       checked_rows, checked_traj_index)

__all__ = [
    "StepwiseAdvantageError",
    "check_stepwise_estimator",
    "last_step_rows",
    "trajectory_scores",
    "run_outcome_estimator",
    "broadcast_step_advantages",
    "compute_trajectory_advantages",
]


def check_stepwise_estimator(adv_estimator: Any, *, allow_custom: bool = False) -> str:
    """Runtime check that ``adv_estimator`` can be used with step-wise rows; returns its name.

    The same question the start-up check asks (:func:`verl_traj.core.plan.estimators.step_row_refusal`): only
    scalar-outcome estimators run per trajectory and broadcast. Unknown (custom-registered) names are rejected
    unless ``allow_custom`` (then the estimator must return ``scalar * response_mask``; checked on its output).
    """
    reason = step_row_refusal(adv_estimator, allow_custom=allow_custom)
    if reason:
        if name_of(adv_estimator) not in ESTIMATORS:
            reason += (" A custom estimator that returns one scalar per response (scalar * response_mask) may pass "
                       "allow_custom=True.")
        raise StepwiseAdvantageError(reason, field="adv_estimator")
    return name_of(adv_estimator)


def last_step_rows(traj_index: torch.Tensor, is_last_step: Any) -> torch.Tensor:
    """``[T]`` row of each trajectory's last step, from the plan's dense ``traj_index`` (``-1`` on padding).

    The layout already validated one last step per trajectory; a batch that breaks it here was changed
    after planning, and the message says which trajectory."""
    traj_index = checked_traj_index(traj_index, None)
    last = checked_flags("is_last_step", is_last_step, traj_index.numel())
    real_last = torch.nonzero(last & (traj_index >= 0)).reshape(-1)
    num_t = int(traj_index.max()) + 1 if traj_index.numel() else 0
    rows = torch.bincount(traj_index[traj_index >= 0], minlength=num_t)
    if num_t and not bool((rows > 0).all()):
        bad = int(torch.nonzero(rows == 0)[0, 0])
        raise StepwiseAdvantageError.invalid(
            "traj_index", traj_index, f"skips trajectory {bad} (no row has it)",
            "pass the plan's dense traj_index 0..T-1 as apply_plan wrote it (do not drop or renumber rows)")
    counts = torch.bincount(traj_index[real_last], minlength=num_t)
    if num_t and not bool((counts == 1).all()):
        bad = int(torch.nonzero(counts != 1)[0, 0])
        raise StepwiseAdvantageError(
            f"trajectory index {bad} has {int(counts[bad])} rows with is_last_step=True; every trajectory needs "
            "exactly one (the row carrying its outcome reward). The batch was changed after planning: keep "
            "is_last_step and traj_index as apply_plan wrote them.", field="is_last_step",
        )
    out = torch.empty(num_t, dtype=torch.long)
    out[traj_index[real_last]] = real_last
    return out


def trajectory_scores(token_level_rewards: torch.Tensor, traj_index: torch.Tensor, last_row: torch.Tensor,
                      reduction: str = "last_step") -> torch.Tensor:
    """One scalar outcome per trajectory, ``[T]``.

    ``"last_step"``: the sum of the last-step row's token rewards (rewards on earlier rows are
    ignored, so a reward function that scores every row cannot count one outcome N times).
    ``"sum"``: the sum over ALL rows of the trajectory (use with KL-in-reward, whose per-token
    penalties sit on every step row).
    """
    if not isinstance(token_level_rewards, torch.Tensor) or token_level_rewards.dim() != 2:
        raise StepwiseAdvantageError.invalid("token_level_rewards", token_level_rewards, "is not a [B, R] tensor",
                                             "pass the batch's token_level_rewards")
    traj_index = checked_traj_index(traj_index, token_level_rewards.shape[0])
    last_row = check_index("last_row", last_row, "pass last_step_rows(traj_index, is_last_step)",
                           high=token_level_rewards.shape[0], error=StepwiseAdvantageError)
    row_sum = token_level_rewards.sum(dim=-1)
    if reduction == "last_step":
        scores = row_sum[last_row.to(row_sum.device)]
    elif reduction == "sum":
        scores = _per_trajectory_sum(row_sum, traj_index, last_row.numel())
    else:
        raise StepwiseAdvantageError(f"reward_reduction={reduction!r} is not one of ['last_step', 'sum']. Fix: pass "
                                     "one of them.", field="reward_reduction")
    if scores.is_floating_point() and not bool(torch.isfinite(scores).all()):  # one reduction on clean batches
        t = int(torch.nonzero(~torch.isfinite(scores))[0, 0])
        row = int(last_row[t])
        if reduction == "sum":  # the first non-finite row of trajectory t (none: its finite rows overflowed)
            bad = torch.nonzero((torch.as_tensor(traj_index).reshape(-1).to(row_sum.device) == t)
                                & ~torch.isfinite(row_sum)).reshape(-1)
            row = int(bad[0]) if bad.numel() else row
        raise StepwiseAdvantageError(
            f"token_level_rewards of trajectory index {t} sum to {float(scores[t])} (row {row}; "
            f"reward_reduction={reduction!r}): a non-finite reward poisons the mean / std of its whole GRPO group. "
            "Fix: make the reward function return a finite number for every trajectory (score failures as 0 or a "
            "penalty, not NaN).", field="token_level_rewards",
        )
    return scores


def _per_trajectory_sum(per_row: torch.Tensor, traj_index: torch.Tensor, num_t: int) -> torch.Tensor:
    real = (traj_index >= 0).to(per_row.device)
    idx = traj_index.to(per_row.device)[real]
    return per_row.new_zeros(num_t).index_add_(0, idx, per_row[real])


def _remax_baselines(reward_baselines: Optional[torch.Tensor], num_t: int) -> torch.Tensor:
    """``[T]`` float32 greedy-rollout rewards that ``remax`` subtracts, checked present and finite."""
    if reward_baselines is None:
        raise StepwiseAdvantageError(
            "adv_estimator='remax' needs reward_baselines (one per trajectory: the greedy rollout's reward). "
            "Fix: keep the batch's reward_baselines.", field="reward_baselines")
    out = reward_baselines.to(torch.float32).reshape(num_t)
    check_finite("reward_baselines", out, "the greedy rollout's reward of every trajectory must be finite (score "
                 "failures as 0 or a penalty, not NaN).", error=StepwiseAdvantageError)
    return out


def run_outcome_estimator(
    estimator_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    scores: torch.Tensor,
    group_uid: np.ndarray,
    *,
    estimator_name: str = "grpo",
    loss_tokens: Optional[torch.Tensor] = None,
    reward_baselines: Optional[torch.Tensor] = None,
    estimator_kwargs: Optional[Mapping[str, Any]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a registered verl outcome estimator once over trajectories; returns (adv [T], ret [T]).

    The estimator sees ``token_level_rewards=[T, 1]`` (the score) and an all-ones ``[T, 1]`` mask
    (for length-aware estimators such as ``opo`` the mask holds each trajectory's loss-token count,
    and the result is divided back by it, which is exact because they return ``scalar * mask``).
    """
    if not isinstance(scores, torch.Tensor) or scores.dim() != 1:
        raise StepwiseAdvantageError.invalid("scores", scores, "is not a [T] tensor", "pass one score per trajectory")
    num_t = scores.shape[0]
    check_per_trajectory(num_t, group_uid=group_uid, loss_tokens=loss_tokens, reward_baselines=reward_baselines)
    if estimator_kwargs is not None and not isinstance(estimator_kwargs, Mapping):
        raise StepwiseAdvantageError.invalid("estimator_kwargs", estimator_kwargs, "is not a mapping",
                                             "pass a dict or None")
    if num_t == 0:
        return scores.new_zeros(0), scores.new_zeros(0)
    check_finite("scores", scores, "every trajectory needs a finite outcome score (a NaN poisons its whole group).",
                 error=StepwiseAdvantageError)
    rewards = scores.detach().to(torch.float32).reshape(num_t, 1).clone()
    if estimator_traits(estimator_name).length_aware:
        if loss_tokens is None:
            raise StepwiseAdvantageError(f"estimator {estimator_name!r} needs loss_tokens per trajectory. Fix: pass "
                                         "each trajectory's loss-token count.", field="loss_tokens")
        mask = loss_tokens.to(torch.float32).reshape(num_t, 1)
    else:
        mask = torch.ones(num_t, 1, dtype=torch.float32, device=rewards.device)
    kwargs: dict[str, Any] = dict(estimator_kwargs or {})
    kwargs.update(token_level_rewards=rewards, response_mask=mask, index=np.asarray(group_uid, dtype=object))
    if estimator_name == "remax":
        kwargs["reward_baselines"] = _remax_baselines(reward_baselines, num_t)
    adv, ret = estimator_fn(**kwargs)
    for out in (adv, ret):
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (num_t, 1):
            raise StepwiseAdvantageError(
                f"estimator {estimator_name!r} returned {type(out).__name__} of shape "
                f"{tuple(getattr(out, 'shape', ()))}, expected ({num_t}, 1): it is not a scalar-outcome estimator. Fix: use an estimator that returns "
                "scalar * response_mask.", field="adv_estimator")
    adv = adv.reshape(num_t)
    ret = ret.reshape(num_t)
    if estimator_traits(estimator_name).length_aware:
        denom = mask.reshape(num_t)
        safe = denom > 0
        adv = torch.where(safe, adv / denom.clamp(min=1e-12), torch.zeros_like(adv))
        ret = torch.where(safe, ret / denom.clamp(min=1e-12), torch.zeros_like(ret))
    return adv, ret


def broadcast_step_advantages(
    traj_scalar_adv: torch.Tensor,
    traj_index: torch.Tensor,
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """``[T]`` trajectory scalars -> ``[B, R]`` token advantages, each row on its OWN response mask.

    ``out[b, t] = traj_scalar_adv[traj_index[b]] * response_mask[b, t]``; rows with
    ``traj_index < 0`` (padding) get 0. Vectorised: one gather and one multiply.
    """
    if not isinstance(response_mask, torch.Tensor) or response_mask.dim() != 2:
        raise StepwiseAdvantageError.invalid("response_mask", response_mask, "is not a [B, R] tensor",
                                             "pass the batch's response_mask")
    traj_index = checked_traj_index(traj_index, response_mask.shape[0])
    num_t = int(traj_index.max()) + 1 if traj_index.numel() else 0
    if not isinstance(traj_scalar_adv, torch.Tensor) or traj_scalar_adv.dim() != 1 or traj_scalar_adv.numel() < num_t:
        raise StepwiseAdvantageError.invalid("traj_scalar_adv", traj_scalar_adv, f"is not a [T] tensor with T >= "
                                             f"{num_t} (traj_index reaches {num_t - 1})",
                                             "pass one value per trajectory")
    device = response_mask.device
    dtype = traj_scalar_adv.dtype if traj_scalar_adv.is_floating_point() else torch.float32
    idx = traj_index.to(device=device, dtype=torch.long)
    valid = idx >= 0
    if traj_scalar_adv.numel() == 0:
        per_row = torch.zeros(idx.shape[0], dtype=dtype, device=device)
    else:
        per_row = traj_scalar_adv.to(device=device, dtype=dtype)[idx.clamp(min=0)] * valid.to(dtype)
    return per_row.unsqueeze(-1) * response_mask.to(dtype)


def _temporal_at_outcome_entry(name: str) -> StepwiseAdvantageError:
    return StepwiseAdvantageError(
        f"algorithm.adv_estimator={name!r} is temporal (a value per token, across turns), but it reached the "
        "step-wise outcome entry (compute_trajectory_advantages), which scores each trajectory once. Fix: set "
        "algorithm.adv_estimator to an outcome estimator (grpo, rloo, reinforce_plus_plus, ...) for this entry; "
        f"to keep {name!r}, let verl_traj's trainer compute the advantages (it runs temporal estimators over each "
        "trajectory's timeline itself, stepwise.timeline.timeline_advantages).", field="algorithm.adv_estimator")


def compute_trajectory_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    traj_index: torch.Tensor,
    is_last_step: Any,
    uid: Sequence[Any] | np.ndarray,
    *,
    estimator_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    estimator_name: str = "grpo",
    reward_reduction: str = "last_step",
    reward_baselines: Optional[torch.Tensor] = None,
    estimator_kwargs: Optional[Mapping[str, Any]] = None,
    allow_custom: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step-wise outcome advantages: estimator once per trajectory, broadcast on each row's own mask.

    Args:
        token_level_rewards: ``[B, R]`` per-row token rewards (the outcome sits on the last-step row).
        response_mask: ``[B, R]`` each row's own loss mask (right-padded responses of any length).
        traj_index: ``[B]`` the plan's dense trajectory index (``-1`` on padding rows: zero advantage).
        is_last_step: ``[B]`` bool; exactly one True per trajectory.
        uid: ``[B]`` GRPO group id per row (all rows of one trajectory share it; the layout checked it).
        estimator_fn: verl's registered estimator, e.g. ``get_adv_estimator_fn("grpo")``.
        estimator_name: its name (validated: temporal estimators raise).
        reward_reduction: ``"last_step"`` (default) or ``"sum"`` (see :func:`trajectory_scores`).
        reward_baselines: ``[B]`` per row (the last-step row's value is used) for ``remax``.
        estimator_kwargs: extra kwargs for the estimator (``config``, ``norm_adv_by_std_in_grpo``, ...).

    Returns:
        ``(advantages [B, R], returns [B, R], traj_adv [T])``.
    """
    name = check_stepwise_estimator(estimator_name, allow_custom=allow_custom)
    if estimator_traits(name).temporal:  # per token: verl_traj.stepwise.timeline, not once per trajectory
        raise _temporal_at_outcome_entry(name)
    checked_rows(token_level_rewards, response_mask)
    rows = response_mask.shape[0]
    traj_index = checked_traj_index(traj_index, rows)
    check_per_row(rows, uid=uid, reward_baselines=reward_baselines)
    last_row = last_step_rows(traj_index, is_last_step)
    loss_tokens = None
    if estimator_traits(name).length_aware:
        loss_tokens = _per_trajectory_sum(response_mask.to(torch.float32).sum(-1), traj_index, last_row.numel())
    baselines = None
    if reward_baselines is not None:
        baselines = torch.as_tensor(reward_baselines).reshape(-1)[last_row.to(torch.as_tensor(reward_baselines).device)]
    traj_adv, traj_ret = run_outcome_estimator(
        estimator_fn,
        trajectory_scores(token_level_rewards, traj_index, last_row, reward_reduction),
        np.asarray(uid, dtype=object)[last_row.numpy()],
        estimator_name=name,
        loss_tokens=loss_tokens,
        reward_baselines=baselines,
        estimator_kwargs=estimator_kwargs,
    )
    advantages = broadcast_step_advantages(traj_adv, traj_index, response_mask)
    returns = broadcast_step_advantages(traj_ret, traj_index, response_mask)
    return advantages, returns, traj_adv
