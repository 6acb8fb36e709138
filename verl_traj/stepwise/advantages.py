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

Pure module: torch, numpy and stdlib only. verl's estimator is passed in as a callable
(``verl.trainer.ppo.core_algos.get_adv_estimator_fn(name)``), so nothing here imports verl.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch

from verl_traj.config import TEMPORAL_ADV_ESTIMATORS

__all__ = [
    "SCALAR_OUTCOME_ADV_ESTIMATORS",
    "UNSUPPORTED_STEPWISE_ADV_ESTIMATORS",
    "StepwiseAdvantageError",
    "TrajectoryIndex",
    "check_stepwise_estimator",
    "index_trajectories",
    "trajectory_scores",
    "trajectory_loss_tokens",
    "run_outcome_estimator",
    "broadcast_step_advantages",
    "compute_trajectory_advantages",
]

# verl 0.9.1 estimators whose advantage is ONE scalar per response (``scalar * response_mask``):
# valid per trajectory and then broadcast. "opo" weights its baseline by response length (we pass
# the trajectory's loss-token count); "remax" needs ``reward_baselines`` per trajectory; "grpo_passk"
# needs ``config``.
SCALAR_OUTCOME_ADV_ESTIMATORS = (
    "grpo",
    "grpo_vectorized",
    "rloo",
    "rloo_vectorized",
    "opo",
    "grpo_passk",
    "gpg",
    "remax",
)
# Length-weighted estimators: the ``[T, 1]`` mask carries the trajectory's loss-token count.
_LENGTH_AWARE = ("opo",)

# Not valid on step rows: temporal / per-token estimators (no cross-step credit path on step rows),
# token-level whitening over the batch, or per-dimension reward keys read from row-level batches.
UNSUPPORTED_STEPWISE_ADV_ESTIMATORS = tuple(TEMPORAL_ADV_ESTIMATORS) + (
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
    "gdpo",
)


class StepwiseAdvantageError(ValueError):
    """Step-wise advantage inputs are inconsistent; the message names the field and the fix."""


def _name(adv_estimator: Any) -> str:
    return str(getattr(adv_estimator, "value", adv_estimator))


def check_stepwise_estimator(adv_estimator: Any, *, allow_custom: bool = False) -> str:
    """Runtime check that ``adv_estimator`` can be used with step-wise rows; returns its name.

    Temporal / per-token estimators (``gae``, ``reinforce_plus_plus``, ...) are rejected: a step row
    is a truncated prefix of the trajectory, so a per-token return computed on it has no path to the
    trajectory's outcome. Unknown (custom-registered) names are rejected unless ``allow_custom``
    (then the estimator must return ``scalar * response_mask``; this is checked on its output).
    """
    name = _name(adv_estimator)
    if name in UNSUPPORTED_STEPWISE_ADV_ESTIMATORS:
        raise StepwiseAdvantageError(
            f"algorithm.adv_estimator={name!r} cannot be used with step-wise rows (traj.step_wise=true): it is "
            "a per-token / temporal estimator (or whitens over row tokens), and a step row carries no "
            "cross-step credit path. Use one of the outcome estimators "
            f"{list(SCALAR_OUTCOME_ADV_ESTIMATORS)} or set traj.step_wise=false to train each trajectory "
            "as one concatenated row."
        )
    if name not in SCALAR_OUTCOME_ADV_ESTIMATORS and not allow_custom:
        raise StepwiseAdvantageError(
            f"algorithm.adv_estimator={name!r} is not a known scalar-outcome estimator; step-wise rows support "
            f"{list(SCALAR_OUTCOME_ADV_ESTIMATORS)}. If your custom estimator returns one scalar per response "
            "(scalar * response_mask), pass allow_custom=True."
        )
    return name


@dataclass(frozen=True)
class TrajectoryIndex:
    """Dense trajectory numbering of a batch of step rows.

    Attributes:
        traj_index: LongTensor [B]: trajectory 0..T-1 of each row (first-appearance order), -1 for
            padding rows.
        last_row: LongTensor [T]: the row holding each trajectory's last step.
        traj_uid: np.ndarray [T] (object): GRPO group id (``uid``) of each trajectory.
        num_trajectories: T.
    """

    traj_index: torch.Tensor
    last_row: torch.Tensor
    traj_uid: np.ndarray
    num_trajectories: int


def _as_bool_tensor(x: Any, n: int, field: str) -> torch.Tensor:
    if x is None:
        return torch.zeros(n, dtype=torch.bool)
    t = torch.as_tensor(np.asarray(x).astype(bool) if not isinstance(x, torch.Tensor) else x).reshape(-1).bool()
    if t.numel() != n:
        raise StepwiseAdvantageError(f"{field} has {t.numel()} entries but the batch has {n} rows.")
    return t.cpu()


def _dense_first_appearance(keys: np.ndarray) -> np.ndarray:
    """Dense ids 0..K-1 in first-appearance order for a 1-D array of hashable keys (vectorised)."""
    if keys.size == 0:
        return np.zeros(0, dtype=np.int64)
    try:
        _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    except TypeError:  # mixed / unorderable object keys
        _, first, inverse = np.unique(keys.astype(str), return_index=True, return_inverse=True)
    rank = np.empty(first.size, dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(first.size, dtype=np.int64)
    return rank[inverse.reshape(-1)]


def index_trajectories(
    traj_id: Sequence[Any] | np.ndarray | torch.Tensor,
    is_last_step: Any,
    uid: Sequence[Any] | np.ndarray,
    is_padding: Any = None,
) -> TrajectoryIndex:
    """Number the trajectories of a batch and find each one's last-step row (vectorised).

    Every non-padding trajectory must have exactly one ``is_last_step`` row, and all its rows must
    share one ``uid``; violations raise ``StepwiseAdvantageError`` naming the trajectory.
    """
    tid = np.asarray(traj_id.cpu().numpy() if isinstance(traj_id, torch.Tensor) else traj_id, dtype=object)
    tid = tid.reshape(-1)
    n = tid.size
    uid_arr = np.asarray(uid, dtype=object).reshape(-1)
    if uid_arr.size != n:
        raise StepwiseAdvantageError(f"uid has {uid_arr.size} entries but traj_id has {n}.")
    last = _as_bool_tensor(is_last_step, n, "is_last_step")
    pad = _as_bool_tensor(is_padding, n, "is_padding")

    real = ~pad.numpy()
    dense = np.full(n, -1, dtype=np.int64)
    dense[real] = _dense_first_appearance(tid[real])
    num_t = int(dense.max()) + 1 if real.any() else 0
    traj_index = torch.from_numpy(dense)

    last_real = last & ~pad
    counts = torch.bincount(traj_index[last_real], minlength=num_t)
    if num_t and not bool((counts == 1).all()):
        bad = int(torch.nonzero(counts != 1)[0, 0])
        first_row = int(np.nonzero(dense == bad)[0][0])
        raise StepwiseAdvantageError(
            f"trajectory {tid[first_row]!r} has {int(counts[bad])} rows with is_last_step=True; every "
            "trajectory needs exactly one (the row carrying its outcome reward). Check the step-wise "
            "agent loop / expand_step_rows output (is_last_step, traj_id)."
        )
    last_row = torch.empty(num_t, dtype=torch.long)
    last_rows = torch.nonzero(last_real).reshape(-1)
    last_row[traj_index[last_rows]] = last_rows

    traj_uid = uid_arr[last_row.numpy()] if num_t else np.zeros(0, dtype=object)
    if num_t:
        row_uid_expected = traj_uid[dense[real]]
        same = row_uid_expected == uid_arr[real]
        if not bool(np.all(same)):
            row = int(np.nonzero(real)[0][np.nonzero(~same)[0][0]])
            raise StepwiseAdvantageError(
                f"rows of trajectory {tid[row]!r} carry different uids ({uid_arr[row]!r} vs "
                f"{row_uid_expected[np.nonzero(~same)[0][0]]!r}); all step rows of a trajectory must share "
                "their GRPO group uid."
            )
    return TrajectoryIndex(traj_index=traj_index, last_row=last_row, traj_uid=traj_uid, num_trajectories=num_t)


def trajectory_scores(
    token_level_rewards: torch.Tensor,
    index: TrajectoryIndex,
    reduction: str = "last_step",
) -> torch.Tensor:
    """One scalar outcome per trajectory, FloatTensor [T].

    ``"last_step"``: the sum of the last-step row's token rewards (rewards on earlier rows are
    ignored, so a reward function that scores every row cannot count one outcome N times).
    ``"sum"``: the sum over ALL rows of the trajectory (use with KL-in-reward, whose per-token
    penalties sit on every step row).
    """
    row_sum = token_level_rewards.sum(dim=-1)
    if reduction == "last_step":
        return row_sum[index.last_row.to(row_sum.device)]
    if reduction == "sum":
        out = row_sum.new_zeros(index.num_trajectories)
        real = index.traj_index >= 0
        idx = index.traj_index[real].to(row_sum.device)
        return out.index_add_(0, idx, row_sum[real.to(row_sum.device)])
    raise StepwiseAdvantageError(f"reward_reduction={reduction!r} is not one of ['last_step', 'sum'].")


def trajectory_loss_tokens(response_mask: torch.Tensor, index: TrajectoryIndex) -> torch.Tensor:
    """Loss (response) tokens of each trajectory over all its step rows, FloatTensor [T]."""
    per_row = response_mask.to(torch.float32).sum(dim=-1)
    real = index.traj_index >= 0
    out = per_row.new_zeros(index.num_trajectories)
    return out.index_add_(0, index.traj_index[real].to(per_row.device), per_row[real.to(per_row.device)])


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
    num_t = scores.shape[0]
    if num_t == 0:
        return scores.new_zeros(0), scores.new_zeros(0)
    rewards = scores.detach().to(torch.float32).reshape(num_t, 1).clone()
    if estimator_name in _LENGTH_AWARE:
        if loss_tokens is None:
            raise StepwiseAdvantageError(f"estimator {estimator_name!r} needs loss_tokens per trajectory.")
        mask = loss_tokens.to(torch.float32).reshape(num_t, 1)
    else:
        mask = torch.ones(num_t, 1, dtype=torch.float32, device=rewards.device)
    kwargs: dict[str, Any] = dict(estimator_kwargs or {})
    kwargs.update(token_level_rewards=rewards, response_mask=mask, index=np.asarray(group_uid, dtype=object))
    if estimator_name == "remax":
        if reward_baselines is None:
            raise StepwiseAdvantageError(
                "adv_estimator='remax' needs reward_baselines (one per trajectory: the greedy rollout's reward)."
            )
        kwargs["reward_baselines"] = reward_baselines.to(torch.float32).reshape(num_t)
    adv, ret = estimator_fn(**kwargs)
    if tuple(adv.shape) != (num_t, 1):
        raise StepwiseAdvantageError(
            f"estimator {estimator_name!r} returned advantages of shape {tuple(adv.shape)}, expected ({num_t}, 1): "
            "it is not a scalar-outcome estimator."
        )
    adv = adv.reshape(num_t)
    ret = ret.reshape(num_t)
    if estimator_name in _LENGTH_AWARE:
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
    if traj_index.numel() != response_mask.shape[0]:
        raise StepwiseAdvantageError(
            f"traj_index has {traj_index.numel()} rows but response_mask has {response_mask.shape[0]}."
        )
    device = response_mask.device
    dtype = traj_scalar_adv.dtype if traj_scalar_adv.is_floating_point() else torch.float32
    idx = traj_index.to(device=device, dtype=torch.long)
    valid = idx >= 0
    if traj_scalar_adv.numel() == 0:
        per_row = torch.zeros(idx.shape[0], dtype=dtype, device=device)
    else:
        per_row = traj_scalar_adv.to(device=device, dtype=dtype)[idx.clamp(min=0)] * valid.to(dtype)
    return per_row.unsqueeze(-1) * response_mask.to(dtype)


def compute_trajectory_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    uid: Sequence[Any] | np.ndarray,
    traj_id: Sequence[Any] | np.ndarray | torch.Tensor,
    is_last_step: Any,
    is_padding: Any = None,
    *,
    estimator_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    estimator_name: str = "grpo",
    reward_reduction: str = "last_step",
    reward_baselines: Optional[torch.Tensor] = None,
    estimator_kwargs: Optional[Mapping[str, Any]] = None,
    allow_custom: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, TrajectoryIndex]:
    """Step-wise outcome advantages: estimator once per trajectory, broadcast on each row's own mask.

    Args:
        token_level_rewards: [B, R] per-row token rewards (the outcome sits on the last-step row).
        response_mask: [B, R] each row's own loss mask (right-padded responses of any length).
        uid: [B] GRPO group id per row (all rows of one trajectory share it).
        traj_id: [B] trajectory id per row (any hashable; padding rows may carry anything).
        is_last_step: [B] bool; exactly one True per trajectory.
        is_padding: [B] bool or None; padding rows get zero advantage and are not trajectories.
        estimator_fn: verl's registered estimator, e.g. ``get_adv_estimator_fn("grpo")``.
        estimator_name: its name (validated: temporal estimators raise).
        reward_reduction: ``"last_step"`` (default) or ``"sum"`` (see ``trajectory_scores``).
        reward_baselines: [B] per row (value of the last-step row is used) for ``remax``.
        estimator_kwargs: extra kwargs for the estimator (``config``, ``norm_adv_by_std_in_grpo``, ...).

    Returns:
        ``(advantages [B, R], returns [B, R], traj_adv [T], index)``.
    """
    name = check_stepwise_estimator(estimator_name, allow_custom=allow_custom)
    if token_level_rewards.shape != response_mask.shape:
        raise StepwiseAdvantageError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must have the same [B, R] shape."
        )
    index = index_trajectories(traj_id, is_last_step, uid, is_padding)
    scores = trajectory_scores(token_level_rewards, index, reward_reduction)
    loss_tokens = trajectory_loss_tokens(response_mask, index) if name in _LENGTH_AWARE else None
    baselines = None
    if reward_baselines is not None:
        baselines = torch.as_tensor(reward_baselines).reshape(-1)[index.last_row.to(torch.as_tensor(reward_baselines).device)]
    traj_adv, traj_ret = run_outcome_estimator(
        estimator_fn,
        scores,
        index.traj_uid,
        estimator_name=name,
        loss_tokens=loss_tokens,
        reward_baselines=baselines,
        estimator_kwargs=estimator_kwargs,
    )
    advantages = broadcast_step_advantages(traj_adv, index.traj_index, response_mask)
    returns = broadcast_step_advantages(traj_ret, index.traj_index, response_mask)
    return advantages, returns, traj_adv, index
