"""One planned update as the contract both trainers hand the workers: what travels with it, every flag derived here.

An update call (the actor's or the critic's) carries

* per-row fields: ``loss_weight`` (``[B]`` float32: the role's
  :class:`~verl_traj.integration.config.update_spec.LossSpec` over the plan's optimizer steps) and, for GSPO at
  ``traj.ratio_scope=trajectory`` where some trajectory has several rows, ``ratio_group`` (``[B]`` int64: each row's
  trajectory);
* the call's non-tensor data (:attr:`UpdateContract.markers`): the planned field names the worker must receive
  (:data:`~verl_traj.core.keys.PLANNED_FIELDS`), whether the old log-probs came from the update's starting
  parameters (:data:`~verl_traj.core.keys.OLD_LOG_PROBS_AT_START`), the critic's mini-batch union
  (:data:`~verl_traj.core.keys.CRITIC_UNION_KEY`, when > 1) and whether GSPO's trajectory ratio comes from the loss
  (:data:`~verl_traj.core.keys.RATIO_IN_LOSS`: the plan put every trajectory in one micro-batch, so no pre-pass).

:func:`update_contract` builds it from the plan's per-row facts; each trainer only moves it into its batch type (v0:
the ``DataProto``'s tensors and ``meta_info``; v1: TransferQueue fields and the meta's ``extra_info``), and the worker
checks it (:func:`~verl_traj.integration.workers.planned_update.check_planned_update`). :func:`pass_markers` is the
non-tensor data of every pass of a planned batch (the prefix-tree marker), read the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from verl_traj.core.keys import (CRITIC_UNION_KEY, LOSS_WEIGHT, OLD_LOG_PROBS_AT_START, PLANNED_FIELDS, RATIO_GROUP,
                                 RATIO_IN_LOSS, TREE_KEY, planned_update_fields)
from verl_traj.integration.config.update_spec import LossSpec, UpdateSpec, has_multi_row_trajectory

__all__ = ["ACTOR", "CRITIC", "UpdateContract", "loss_of", "pass_markers", "update_contract"]

ACTOR, CRITIC = "actor", "critic"


@dataclass(frozen=True)
class UpdateContract:
    """``fields``: per-row ``[B]`` tensors to store with the rows; ``markers``: the call's non-tensor data."""

    fields: dict[str, torch.Tensor]
    markers: dict[str, Any]

    @property
    def planned(self) -> tuple[str, ...]:
        """The planned field names the worker checks it received."""
        return tuple(self.markers[PLANNED_FIELDS].split(","))


def loss_of(spec: UpdateSpec, role: str) -> LossSpec:
    """The loss aggregation of ``role``'s updates (the critic's exists only with a critic)."""
    loss = {ACTOR: spec.actor_loss, CRITIC: spec.critic_loss}.get(role)
    if loss is None:
        raise ValueError(f"role={role!r}: an update is the {ACTOR!r}'s or, with a critic, the {CRITIC!r}'s")
    return loss


def update_contract(spec: UpdateSpec, role: str, loss_weight: torch.Tensor, traj_index: torch.Tensor,
                    is_padding: torch.Tensor, *, all_atomic: bool, local_step: int = 0) -> UpdateContract:
    """The contract of one ``role`` update (:data:`ACTOR` or :data:`CRITIC`) of the planned rows (``[B]`` each:
    ``loss_weight`` from :func:`loss_of`, ``traj_index`` -1 on padding, ``is_padding``). ``all_atomic``: the plan
    put every trajectory in one micro-batch on one rank (:attr:`~verl_traj.core.MiniBatchPlan.all_trajectories_atomic`);
    ``local_step``: the update's index in its weight-sync cycle (v1; 0 on v0). The old log-probs came from the
    update's starting parameters unless the trainer reuses a cycle's first (:attr:`UpdateSpec.reuses_old_log_probs`)
    and this is a later local step."""
    loss_of(spec, role)
    # a one-row trajectory's ratio is its row's: ratio groups only where some trajectory has several rows
    ratio_groups = role == ACTOR and spec.ratio_groups and has_multi_row_trajectory(traj_index, is_padding)
    fields = {LOSS_WEIGHT: loss_weight, **({RATIO_GROUP: traj_index.clone()} if ratio_groups else {})}
    union = spec.critic_union if role == CRITIC else 1
    markers = {PLANNED_FIELDS: ",".join(planned_update_fields(ratio_groups)),
               OLD_LOG_PROBS_AT_START: not spec.reuses_old_log_probs or int(local_step) == 0,
               **({CRITIC_UNION_KEY: union} if union > 1 else {}),
               **({RATIO_IN_LOSS: True} if ratio_groups and all_atomic else {})}
    return UpdateContract(fields, markers)


def pass_markers(spec: UpdateSpec) -> dict[str, Any]:
    """The non-tensor data of every pass of a planned batch (log-probs, reference, values, updates): with
    ``traj.prefix_tree`` the workers forward its micro-batches as prefix trees."""
    return {TREE_KEY: True} if spec.traj_config.trees else {}
