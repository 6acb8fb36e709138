"""GSPO at ``traj.ratio_scope=trajectory`` on the actor worker: each row's sequence ratio made its trajectory's.

verl's GSPO loss computes each row's sequence ratio from the live log-probs of that row alone. Before an optimizer
step, :func:`trajectory_ratio_shift` runs one no-grad forward over the step's mini-batch (the plan's micro-batches,
this step's parameters) in the training forward's mode, with the random-number state forked and restored, so the
training forward that follows draws the same dropout masks and computes the same log-probs; it sums each
trajectory's log-ratios over its rows on every rank (one all-reduce) and returns the per-row shift of the old
log-probs (:func:`~verl_traj.stepwise.ratios.sequence_ratio_shift`) that makes every row's mean log-ratio its
trajectory's. No host read on the way: the trajectories are summed into a table of a static size (a bound on their
number every rank knows, :func:`ratio_group_bound`; the groups are checked against it once per update on the host),
the shift stays on the device, and rows with a non-finite log-prob come back as device counts.
:func:`stochastic_in_training` says whether a training forward draws random numbers at all (where it does not, the
first optimizer step of an update, whose parameters computed the old log-probs, needs no pre-pass).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from tensordict import TensorDict

from verl.utils.device import get_device_id, get_device_name
from verl.workers.utils.padding import no_padding_2_padding

from verl_traj.core.errors import check_index
from verl_traj.core.keys import RATIO_GROUP
from verl_traj.stepwise.ratios import bounded_group_sums, nonfinite_rows, presummed_ratio_shift, row_log_ratio_sums

__all__ = ["check_ratio_groups", "ratio_group_bound", "stochastic_in_training", "trajectory_ratio_shift"]


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


def trajectory_ratio_shift(verl_forward_backward: Callable, batch: TensorDict, group_dp: Any,
                           num_groups: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``([b] float shift of each row's old log-probs, {field: 0-d rows with a non-finite value on a loss token}``
    for ``old_log_probs`` and the pre-pass's ``log_probs``), on the forward's device: verl's
    ``forward_backward_batch(batch, None, forward_only=True)`` under ``no_grad`` and a forked RNG (restored on exit),
    then the trajectories' log-ratio sums over every rank of ``group_dp`` (``batch[RATIO_GROUP]``: each row's
    trajectory in ``[-1, num_groups)``, ``-1`` on padding rows)."""
    device = get_device_name()  # the accelerator verl runs on ("cuda", "npu", ...), "cpu" without one
    devices = [] if device == "cpu" else [get_device_id()]
    with torch.random.fork_rng(devices=devices, device_type=device if devices else "cuda"), torch.no_grad():
        output = verl_forward_backward(batch, None, forward_only=True)
    log_prob = no_padding_2_padding(output["model_output"]["log_probs"], batch)
    padded = batch.select("old_log_probs", "response_mask").to_padded_tensor()
    old, mask = padded["old_log_probs"].to(log_prob.device), padded["response_mask"].to(log_prob.device)
    group = batch[RATIO_GROUP].to(log_prob.device).long()
    per_row = row_log_ratio_sums(log_prob, old, mask)
    sums = bounded_group_sums(per_row, group, num_groups)
    torch.distributed.all_reduce(sums, op=torch.distributed.ReduceOp.SUM, group=group_dp)
    nonfinite = {"old_log_probs": nonfinite_rows(old, mask, group), "log_probs": nonfinite_rows(log_prob, mask, group)}
    return presummed_ratio_shift(per_row, group, sums, old.dtype), nonfinite
