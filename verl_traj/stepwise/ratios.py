"""Trajectory-scoped importance ratios: one off-policy correction per trajectory, not one per step row.

verl's rollout correction (``algorithm.rollout_correction``) computes its sequence-level quantities per row: the
sequence IS weight ``exp(sum of log-ratios)`` (``rollout_is=sequence``), the sequence rejection statistics
(``rollout_rs=seq_sum_k*``, ``seq_mean_k*`` -- the geometric mean of the ratio --, ``seq_max_k*``) and the
per-sequence off-policy diagnostics. With step rows a six-call trajectory gets six independent "sequence" weights,
each over a fraction of the agent's decisions, while the trajectory's likelihood ratio is their product; a
sequence rejection drops some of its rows and keeps others.

With ``traj.ratio_scope=trajectory`` verl's own function runs on each trajectory's timeline
(:class:`~verl_traj.stepwise.timeline.Timeline`: its rows in step order, their loss tokens one after the other), so
"sequence" means trajectory, with verl's normalisation per sequence: the IS weight is the product of the
trajectory's token ratios, a rejection drops the whole trajectory, ``seq_mean`` averages over all its loss tokens.
Token-level modes give the same values either way (the timeline holds every loss token once). The results go back
to each row's own tokens with one scatter. Exact: a trajectory as k step rows, in any order and with padding rows,
gets the weights and mask of the same trajectory as one merged row.

GSPO's sequence ratio is computed inside the actor's loss from the *current* policy, per row:
``exp(mean over the row's tokens of (log_prob - old_log_prob))``, detached. At trajectory scope the mean runs over
every loss token of the trajectory, wherever its rows sit (other micro-batches, other ranks): the actor runs one
no-grad forward over each mini-batch under the parameters of that optimizer step, sums each trajectory's log-ratios
(:func:`group_log_ratio_sums`, all-reduced over the ranks) and shifts each row's old log-probs by a constant
(:func:`sequence_ratio_shift`) so that verl's own GSPO loss sees the trajectory's mean as the row's.

Inside the update these run on the device every optimizer step or micro-batch, so that path has sync-free versions
(no host read, no data-dependent shape; the inputs checked once per update on the host instead):
:func:`row_log_ratio_sums`, :func:`bounded_group_sums` (the pre-pass: a static bound on the number of
trajectories), :func:`presummed_ratio_shift` and :func:`micro_batch_ratio_shift` (every trajectory's rows in one
micro-batch: the ratio from the loss's own log-probs); the callers count the rows with a non-finite log-prob on the
device (:func:`nonfinite_rows`) instead of raising on the spot. The pre-pass's table has a static size every rank
knows (:func:`ratio_group_bound`; the groups are checked against it once per update, :func:`check_ratio_groups`), and
:func:`stochastic_in_training` says whether a training forward draws random numbers at all (where it does not, the
first optimizer step of an update, whose parameters computed the old log-probs, needs no pre-pass).

Pure module (torch only); verl's function is passed in as a callable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from verl_traj.core.errors import TrajInputError, check_finite, check_index, check_int, check_shape
from verl_traj.core.keys import RATIO_GROUP
from verl_traj.stepwise.timeline import Timeline

__all__ = ["RATIO_SCOPES", "TrajectoryCorrection", "bounded_group_sums", "check_ratio_groups", "group_log_ratio_sums",
           "micro_batch_ratio_shift", "nonfinite_rows", "presummed_ratio_shift", "row_log_ratio_sums",
           "ratio_group_bound", "sequence_ratio_shift", "stochastic_in_training", "trajectory_ratio_metrics",
           "trajectory_rollout_correction"]

RATIO_SCOPES = ("row", "trajectory")
SAFETY_BOUND = 20.0  # verl's clamp of a log-ratio sum before exp (rollout_corr_helper.SAFETY_BOUND)


@dataclass(frozen=True)
class TrajectoryCorrection:
    """verl's rollout correction at trajectory scope, back on the rows: ``weights`` ``[B, R]`` (``None`` without
    ``rollout_is``), ``response_mask`` ``[B, R]`` (rejected trajectories zeroed), verl's ``metrics`` (per trajectory
    where verl's are per sequence) and the timeline's ``log_ratio_sum`` ``[T]`` and ``kept`` ``[T]``."""

    weights: Optional[torch.Tensor]
    response_mask: torch.Tensor
    metrics: dict[str, float]
    log_ratio_sum: torch.Tensor
    kept: torch.Tensor


def trajectory_rollout_correction(
    correction_fn: Callable[..., tuple[Any, torch.Tensor, dict]],
    timeline: Timeline,
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    **correction_kwargs: Any,
) -> TrajectoryCorrection:
    """Run ``correction_fn`` (verl's ``compute_rollout_correction_and_rejection_mask(old_log_prob, rollout_log_prob,
    response_mask, **kwargs) -> (weights DataProto | None, mask, metrics)``) on ``timeline``'s ``[T, L]`` layout.

    Args:
        old_log_prob, rollout_log_prob: ``[B, R]`` per row (the trainer's and the rollout engine's log-probs).
        response_mask: ``[B, R]``; the timeline must have been built from it.
    Returns:
        :class:`TrajectoryCorrection`; masked positions and padding rows get weight 0 and mask 0, as verl's do."""
    fix = "pass [B, R] tensors of the batch the timeline was built from (Timeline.build on its response_mask)"
    for name, tensor in (("old_log_prob", old_log_prob), ("rollout_log_prob", rollout_log_prob),
                         ("response_mask", response_mask)):
        check_shape(name, tensor, timeline.shape, fix)
    old_t, roll_t = timeline.gather(old_log_prob.float()), timeline.gather(rollout_log_prob.float())
    _check_log_probs("old_log_prob", old_t, "the trainer's log-prob pass returned NaN: check the model / its inputs")
    _check_log_probs("rollout_log_prob", roll_t, "the rollout engine returned NaN log-probs: record them per token")
    mask_t = timeline.mask(old_t)
    weights_proto, kept_mask_t, metrics = correction_fn(old_t, roll_t, mask_t, **correction_kwargs)
    weights = None
    if weights_proto is not None:
        weights = timeline.scatter(weights_proto.batch["rollout_is_weights"]).to(old_log_prob.dtype)
    mask = timeline.scatter(kept_mask_t.to(mask_t.dtype)).to(response_mask.dtype) * (response_mask != 0)
    kept = ((kept_mask_t != 0) | (mask_t == 0)).all(-1)
    return TrajectoryCorrection(weights, mask, metrics, ((old_t - roll_t) * mask_t).sum(-1), kept)


def trajectory_ratio_metrics(correction: TrajectoryCorrection, row_log_ratio_sum: torch.Tensor,
                             row_traj: torch.Tensor, prefix: str = "traj_ratio") -> dict[str, float]:
    """``traj_ratio/*``: the trajectory's log-ratio sum and its IS weight ``exp(sum)`` (before verl's truncation),
    mean / min / max over trajectories; ``row_weight_*``: what row scope would give each row, ``exp(row's sum)``, for
    comparison; the share of trajectories rejected, and ``max_abs_row_gap``: how far each
    trajectory's log-ratio sum is from the sum of its rows' (the trajectory weight is the product of the rows' weights:
    0 up to float rounding).

    Args:
        row_log_ratio_sum: ``[B]`` each row's own masked log-ratio sum; ``row_traj``: ``[B]`` its trajectory (-1 pad).
    """
    s = correction.log_ratio_sum
    if s.numel() == 0:
        return {}
    real = row_traj >= 0
    rows_total = torch.zeros_like(s).index_add_(0, row_traj[real].long(), row_log_ratio_sum[real].to(s.dtype))
    weight = torch.exp(s.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    row_weight = torch.exp(row_log_ratio_sum[real].to(s.dtype).clamp(-SAFETY_BOUND, SAFETY_BOUND))
    return {f"{prefix}/log_ratio_sum_mean": float(s.mean()), f"{prefix}/weight_mean": float(weight.mean()),
            f"{prefix}/weight_min": float(weight.min()), f"{prefix}/weight_max": float(weight.max()),
            f"{prefix}/row_weight_mean": float(row_weight.mean()), f"{prefix}/row_weight_min": float(row_weight.min()),
            f"{prefix}/rejected_share": float((~correction.kept).float().mean()),
            f"{prefix}/trajectories": float(s.numel()),
            f"{prefix}/max_abs_row_gap": float((s - rows_total).abs().max())}


def _check_log_probs(name: str, t: torch.Tensor, fix: str) -> None:
    """Refuse NaN and +inf log-probs (a log-prob is <= 0; -inf is clamped by verl's safety bound)."""
    bad = torch.isnan(t) | (t == float("inf"))
    if bool(bad.any()):
        raise TrajInputError(f"{name} holds {int(bad.sum())} NaN / +inf value(s) on loss tokens (first: "
                             f"{t[bad][0].item()}). Fix: {fix}.", field=name)


def _check_rows(log_prob: Any, old_log_prob: Any, response_mask: Any, group: Any, num_groups: Any) -> tuple:
    """Shapes ``[b, R]`` x 3 and ``[b]``, ``group`` in ``[-1, num_groups)``: ``(group, num_groups)`` checked."""
    if not isinstance(log_prob, torch.Tensor) or log_prob.dim() != 2:
        raise TrajInputError.invalid("log_prob", log_prob, "is not a [b, R] tensor", "pass the forward's log-probs")
    fix = "pass [b, R] tensors of the same rows (log_prob, old_log_prob, response_mask)"
    check_shape("old_log_prob", old_log_prob, tuple(log_prob.shape), fix)
    check_shape("response_mask", response_mask, tuple(log_prob.shape), fix)
    num_groups = check_int("num_groups", num_groups, "pass the number of trajectories (max group + 1)", minimum=0)
    group = check_index("group", group, f"pass each row's trajectory in [-1, {num_groups}) (-1: padding)",
                        rows=log_prob.shape[0], low=-1, high=max(num_groups, 0)).to(log_prob.device)
    return group, num_groups


def group_log_ratio_sums(log_prob: torch.Tensor, old_log_prob: torch.Tensor, response_mask: torch.Tensor,
                         group: torch.Tensor, num_groups: int) -> torch.Tensor:
    """``[num_groups, 2]`` float64: per group (trajectory), the sum of ``log_prob - old_log_prob`` over its loss
    tokens among these rows, and their count; rows with ``group < 0`` (padding) count nowhere. Sums of disjoint row
    sets add up (all-reduce them over ranks and micro-batches).

    Args:
        log_prob, old_log_prob, response_mask: ``[b, R]``; group: ``[b]`` int64 in ``[-1, num_groups)``.
    Raises:
        TrajInputError: shapes that differ, a group out of range, a NaN / inf log-ratio on a real row's loss token."""
    group, num_groups = _check_rows(log_prob, old_log_prob, response_mask, group, num_groups)
    per_row = row_log_ratio_sums(log_prob, old_log_prob, response_mask)
    real = group >= 0
    if not bool(torch.isfinite(per_row[real]).all()):  # one reduction on a clean batch
        on_loss = (response_mask != 0) & real[:, None]
        name = "old_log_prob" if not bool(torch.isfinite(old_log_prob[on_loss]).all()) else "log_prob"
        check_finite(name, (log_prob if name == "log_prob" else old_log_prob)[on_loss],
                     "a non-finite log-prob on a loss token poisons its trajectory's sequence ratio")
    return bounded_group_sums(per_row, group, num_groups)


def sequence_ratio_shift(log_prob: torch.Tensor, old_log_prob: torch.Tensor, response_mask: torch.Tensor,
                         group: torch.Tensor, group_sums: torch.Tensor) -> torch.Tensor:
    """``[b]`` (``old_log_prob``'s dtype) the constant ``c`` per row with ``mean over the row's loss tokens of
    (log_prob - (old_log_prob + c)) == the row's group's mean log-ratio`` (``group_sums``: the global
    :func:`group_log_ratio_sums`); 0 on rows with ``group < 0`` or no loss token. Detached: GSPO uses the sequence
    ratio only as a stop-gradient factor."""
    if not isinstance(group_sums, torch.Tensor) or group_sums.dim() != 2 or group_sums.shape[1] != 2:
        raise TrajInputError.invalid("group_sums", group_sums, "is not a [G, 2] tensor",
                                     "pass group_log_ratio_sums(...) (all-reduced over the ranks)")
    group, _ = _check_rows(log_prob, old_log_prob, response_mask, group, group_sums.shape[0])
    own = torch.where(group >= 0, torch.arange(group.numel(), device=group.device), -1)  # each real row its own group
    mine = group_log_ratio_sums(log_prob, old_log_prob, response_mask, own, group.numel())  # [b, 2], checked
    return presummed_ratio_shift(mine, group, group_sums, old_log_prob.dtype)


def row_log_ratio_sums(log_prob: torch.Tensor, old_log_prob: torch.Tensor,
                       response_mask: torch.Tensor) -> torch.Tensor:
    """``[b, 2]`` float64 per row: the sum of ``log_prob - old_log_prob`` over its loss tokens, and their count
    (``[b, R]`` inputs; masked positions never enter, NaN included). No check, no host sync."""
    on = response_mask != 0
    diff = torch.where(on, log_prob.double() - old_log_prob.double(), 0.0)
    return torch.stack([diff.sum(-1), on.sum(-1).to(torch.float64)], -1)


def nonfinite_rows(values: torch.Tensor, response_mask: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """0-d int64 on ``values``' device: real rows (``group >= 0``) with a NaN / inf in ``values`` ``[b, R]`` (log-probs)
    on a loss token (``response_mask != 0``)."""
    on = response_mask.to(values.device) != 0
    bad = (on & ~torch.isfinite(values)).any(-1)
    return (bad & (group.to(values.device) >= 0)).sum()


def bounded_group_sums(per_row: torch.Tensor, group: torch.Tensor, num_groups: int) -> torch.Tensor:
    """``[num_groups, 2]`` float64: :func:`row_log_ratio_sums` summed per group (``group`` ``[b]`` int in
    ``[-1, num_groups)``, padding rows -1 add nothing); ``num_groups`` any bound above the largest group (a static
    size: no host read). Unchecked: check ``group`` once on the host (:func:`~verl_traj.core.errors.check_index`)."""
    group = group.long()
    values = torch.where((group >= 0)[:, None], per_row, torch.zeros_like(per_row))
    return per_row.new_zeros((int(num_groups), 2)).index_add_(0, group.clamp(min=0), values)


def presummed_ratio_shift(per_row: torch.Tensor, group: torch.Tensor, group_sums: torch.Tensor,
                          dtype: torch.dtype) -> torch.Tensor:
    """``[b]`` (``dtype``) :func:`sequence_ratio_shift` from the rows' :func:`row_log_ratio_sums` and their groups'
    sums (``group_sums[group]``); 0 on rows with ``group < 0`` or no loss token; detached. No check, no host sync."""
    group = group.long()
    g = group.clamp(min=0)
    row_mean = per_row[:, 0] / per_row[:, 1].clamp(min=1)
    traj_mean = group_sums[g, 0] / group_sums[g, 1].clamp(min=1)
    keep = (group >= 0) & (per_row[:, 1] > 0)
    return torch.where(keep, row_mean - traj_mean, torch.zeros_like(row_mean)).to(dtype).detach()


def micro_batch_ratio_shift(log_prob: torch.Tensor, old_log_prob: torch.Tensor, response_mask: torch.Tensor,
                            group: torch.Tensor) -> torch.Tensor:
    """``[b]`` :func:`sequence_ratio_shift` where every row of each trajectory is in these ``b`` rows (GSPO's ratio
    in the loss), without a host sync: each trajectory is summed into the slot of its first row here (a ``[b, b]``
    comparison; ``b`` is a micro-batch's rows). ``group`` ``[b]``: each row's trajectory, ``-1`` on padding rows; a
    non-finite log-prob poisons only its own trajectory's shift (count them with :func:`nonfinite_rows`)."""
    group = group.to(log_prob.device).long()
    per_row = row_log_ratio_sums(log_prob.detach(), old_log_prob.to(log_prob.device), response_mask.to(log_prob.device))
    real = group >= 0
    first = ((group[:, None] == group[None, :]) & real[:, None]).long().argmax(-1)  # [b] first row of its trajectory
    sums = bounded_group_sums(per_row, torch.where(real, first, -1), group.shape[0])
    return presummed_ratio_shift(per_row, first.where(real, -1), sums, old_log_prob.dtype)


def ratio_group_bound(rows_per_rank: int, dp_size: int) -> int:
    """An upper bound on the trajectories of an update every rank computes alike without communication: its rows
    (``traj_index`` is dense over the batch's real rows, and every rank holds the same number of rows)."""
    return max(int(rows_per_rank) * int(dp_size), 1)


def check_ratio_groups(group: torch.Tensor, bound: int) -> None:
    """Once per update, on the update's host copy: ``ratio_group`` ``[B]`` integers in ``[-1, bound)``, else a
    :class:`~verl_traj.core.errors.TrajInputError` naming the row."""
    check_index(RATIO_GROUP, group, f"pass each row's trajectory in [-1, {bound}) (-1: padding), as the trainer's "
                "traj_index", low=-1, high=bound)


def stochastic_in_training(module: Any) -> bool:
    """Whether a training-mode forward of ``module`` draws random numbers: a dropout layer with ``p > 0`` (LoRA's
    included) or a model config with a positive ``*dropout*`` / ``*jitter*`` setting (HF attention applies
    ``attention_dropout`` functionally; MoE routers add jitter noise). Unknown modules count as stochastic."""
    if not isinstance(module, torch.nn.Module):
        return True
    for sub in module.modules():
        if isinstance(sub, torch.nn.modules.dropout._DropoutNd) and sub.p > 0:
            return True
        config = getattr(sub, "config", None)
        if hasattr(config, "to_dict"):
            for key, value in config.to_dict().items():
                if ("dropout" in key or "jitter" in key) and isinstance(value, (int, float)) and value > 0:
                    return True
    return False
