"""The plan's per-row facts on v1's driver (:class:`PlanFacts`): what the advantage and the loss weights read of the
batch planned last, kept on the trainer instead of in TransferQueue.

v1's fields are fixed per batch (the workers pull the stored fields common to every row), and verl builds the
advantage's ``DataProto`` from a fixed field list, so the facts ride from the planner to the advantage and the
updates here, in dispatch order, checked against the batch's keys once per batch (the trainer's ``_facts_of``). They
are immutable values: born in ``_balance_batch`` (:func:`plan_facts`), replaced by the advantage step's
(:meth:`~PlanFacts.with_final_loss_tokens`, :meth:`~PlanFacts.with_advantage_metrics`: a new value handed back to the
trainer), read
by :mod:`~verl_traj.integration.trainers.v1_advantage` (advantage, rollout correction) and
:mod:`~verl_traj.integration.trainers.v1_updates` (loss weights).

Loss tokens per row are counted where the mask is born (planning: one fetch of ``response_mask``) and again where it
is final (verl's rollout correction may zero tokens before the advantage, which has the corrected mask in memory):
the loss weights need only these counts, never the ``[B, R]`` mask.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

import torch

from verl_traj.core import BatchLayout, MiniBatchPlan
from verl_traj.core.keys import (IS_LAST_STEP, IS_PADDING, STEP_ANCHORS, TRAJ_INDEX, TREE_CALLS, TREE_OUTCOMES,
                                 TURN_REWARDS)
from verl_traj.core.rollout.row_key import parse_row_keys
from verl_traj.core.rollout.row_tags import TREE_CALLS_TAG, TREE_OUTCOMES_TAG, anchor_entries, tag_entries
from verl_traj.core.rollout.row_tags import turn_reward_entries

__all__ = ["STEP_INDEX", "PlanFacts", "StepFacts", "plan_facts", "row_loss_tokens"]

# the field the step-wise advantage reads each row's step from (on v1 fixed: traj.step_index_key is for v0 batches)
STEP_INDEX = "step_index"


def row_loss_tokens(mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64 non-zero entries per row of a ``[B, R]`` mask, dense or jagged (TQ's nested layout)."""
    if mask.is_nested:
        lengths = mask.offsets().diff()
        rows = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        return torch.zeros(lengths.numel(), dtype=torch.int64).index_add_(0, rows, (mask.values() != 0).long())
    return (mask != 0).sum(-1).long()


@dataclass(frozen=True)
class PlanFacts:
    """The plan's per-row facts of the batch planned last, in dispatch order (``[B]`` CPU tensors each).

    Invariants: ``keys`` are the planned batch's row keys in dispatch order; padding rows have ``traj_index == -1``,
    ``is_last_step`` False and ``loss_tokens == 0``. Immutable: ``loss_tokens`` is counted at planning, and the
    advantage step hands on a new value with it recounted from the final mask (:meth:`with_final_loss_tokens`)."""

    keys: tuple[str, ...]
    traj_index: torch.Tensor  # int64, -1 on padding
    is_last_step: torch.Tensor  # bool
    is_padding: torch.Tensor  # bool
    mini_batch_id: torch.Tensor  # int64
    loss_tokens: torch.Tensor  # int64, loss tokens of each row (0 on padding)
    multi_row: bool  # some trajectory has several rows (steps)
    all_atomic: bool = False  # every trajectory in one micro-batch on one rank (MiniBatchPlan.all_trajectories_atomic)
    turn_rewards: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None  # (row, position, reward) [K]
    step_anchors: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None  # (row, position, key) [K], gigpo
    # a branching session's rows (issue 56): (row, position, packed leaf span) and (row, position, own outcome) [K]
    tree_calls: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
    tree_outcomes: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
    # the advantage step's (traj_gigpo/*), for the step's metrics; read-only
    advantage_metrics: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    # a branching session's parts from the advantage step ([B, R], dispatch order): the two-sign part (None: no call
    # with leaves of both signs) and, under traj.branch_weighting=expanded, each token's path copies (None: one each);
    # put into TransferQueue with the advantages for the actor's loss (v1_advantage.PutWithTreeParts)
    advantages_negative: Optional[torch.Tensor] = None
    path_copies: Optional[torch.Tensor] = None
    # the plan's per-row worker fields (v1_planning.plan_row_fields), each row's rank and attended tokens: what the
    # workers' calls ship (v1_updates.plan_blocks)
    row_fields: Mapping[str, torch.Tensor] = field(default_factory=lambda: MappingProxyType({}))
    rank: Optional[torch.Tensor] = None  # int64
    row_length: Optional[torch.Tensor] = None  # int64

    @property
    def stepwise(self) -> bool:
        """The step-wise advantage path: a trajectory with several rows, or turn rewards to put on tokens."""
        return (self.multi_row or self.turn_rewards is not None or self.step_anchors is not None
                or self.tree_calls is not None)

    def check(self, keys: list[str]) -> None:
        """Raise unless ``keys`` are the planned keys, in the planned order."""
        if tuple(keys) != self.keys:
            first = next((i for i, (a, b) in enumerate(zip(keys, self.keys)) if a != b), min(len(keys), len(self.keys)))
            raise RuntimeError(
                f"the batch's keys are not the ones _balance_batch planned ({len(keys)} rows vs {len(self.keys)} "
                f"planned; first difference at row {first}): something between balancing and this step reordered or "
                "replaced rows. verl_traj needs the planned order."
            )

    def attach(self, data: Any, keys: list[str]) -> None:
        """Carry the facts into a verl ``DataProto`` that verl built from TransferQueue for one driver step (its
        field lists are fixed, so the facts travel from here, as on v0 they travel in the batch): ``is_padding`` and
        ``traj_index`` tensors, ``is_last_step`` and ``step_index`` (the step of each row, read from its key), the
        turn rewards on their tokens (``keys``: the batch's, which the trainer checked against the planned ones).
        :func:`verl_traj.integration.rows.real_rows.is_padding` then reads the padding flag, on both trainers."""
        td = data.batch
        td[IS_PADDING] = self.is_padding.to(td.device)
        td[TRAJ_INDEX] = self.traj_index.to(td.device)
        data.non_tensor_batch[IS_LAST_STEP] = self.is_last_step.numpy()
        data.non_tensor_batch[STEP_INDEX] = parse_row_keys(keys).step
        if self.turn_rewards is not None:  # the sparse tags back on their tokens (v0's expansion writes the same)
            row, pos, reward = self.turn_rewards
            dense = torch.zeros(td["response_mask"].shape, dtype=torch.float32)
            td[TURN_REWARDS] = dense.index_put_((row, pos), reward, accumulate=True).to(td.device)
        if self.step_anchors is not None:  # each call's anchor key on its first response token (gigpo)
            row, pos, key = self.step_anchors
            dense = torch.zeros(td["response_mask"].shape, dtype=torch.int64)
            td[STEP_ANCHORS] = dense.index_put_((row, pos), key).to(td.device)
        if self.tree_calls is not None:  # a branching session's leaf spans and leaves' own outcomes
            for name, entries, dtype in ((TREE_CALLS, self.tree_calls, torch.int64),
                                         (TREE_OUTCOMES, self.tree_outcomes, torch.float32)):
                dense = torch.zeros(td["response_mask"].shape, dtype=dtype)
                if entries is not None:
                    dense.index_put_(entries[:2], entries[2])
                td[name] = dense.to(td.device)

    def with_final_loss_tokens(self, response_mask: torch.Tensor) -> "PlanFacts":
        """These facts with :attr:`loss_tokens` recounted from the batch's final ``[B, R]`` ``response_mask``
        (dispatch order; after verl's rollout correction, which may zero tokens). A new value."""
        counts = row_loss_tokens(response_mask.detach().cpu())
        if counts.shape != self.loss_tokens.shape:
            raise RuntimeError(f"response_mask has {counts.numel()} rows, the plan {self.loss_tokens.numel()}")
        return dataclasses.replace(self, loss_tokens=torch.where(self.is_padding, 0, counts))

    def with_advantage_metrics(self, metrics: Mapping[str, float]) -> "PlanFacts":
        """These facts with the advantage step's ``metrics`` (read-only). A new value."""
        return dataclasses.replace(self, advantage_metrics=MappingProxyType(dict(metrics)))

    def with_tree_parts(self, negative: Optional[torch.Tensor], copies: Optional[torch.Tensor],
                        response_mask: torch.Tensor) -> "PlanFacts":
        """These facts with a branching session's parts (``[B, R]`` each or ``None``); with ``copies`` each row's loss
        tokens count each token as its path copies (``response_mask``: the final one). A new value."""
        tokens = self.loss_tokens
        if copies is not None:
            counts = ((response_mask.detach().cpu() != 0) * copies.detach().cpu().double()).sum(-1).round().long()
            tokens = torch.where(self.is_padding, 0, counts)
        return dataclasses.replace(self, advantages_negative=negative, path_copies=copies, loss_tokens=tokens)


def plan_facts(batch: Any, plan: MiniBatchPlan, layout: BatchLayout, row_fields: Mapping[str, torch.Tensor],
               row_length: torch.Tensor) -> PlanFacts:
    """The plan's per-row facts in dispatch order (``batch``: the planned batch's keys and tags, padding rows
    included; ``layout``: the rows before planning, in the order ``plan.order`` indexes; ``row_fields``: the plan's
    worker fields; ``row_length``: each planned row's attended tokens)."""
    src = plan.order.clamp(min=0)
    return PlanFacts(
        row_fields=MappingProxyType(dict(row_fields)), rank=plan.rank.clone(), row_length=row_length,
        keys=tuple(batch.keys), traj_index=plan.traj_index.clone(),
        is_last_step=layout.is_last_step[src] & ~plan.is_padding, is_padding=plan.is_padding.clone(),
        mini_batch_id=plan.mini_batch_id.clone(),
        loss_tokens=torch.where(plan.is_padding, 0, layout.num_loss_tokens[src]).long(),
        multi_row=bool((layout.traj_num_steps > 1).any()), all_atomic=plan.all_trajectories_atomic, turn_rewards=turn_reward_entries(batch.tags),
        step_anchors=anchor_entries(batch.tags), tree_calls=tag_entries(batch.tags, TREE_CALLS_TAG, torch.int64),
        tree_outcomes=tag_entries(batch.tags, TREE_OUTCOMES_TAG, torch.float32),
    )


class StepFacts:
    """The trainer's facts of the batch planned last: set at planning (:meth:`planned`), replaced by the advantage
    step's new value (:meth:`hand_on`), checked against a batch's keys once per batch (:meth:`of`)."""

    def __init__(self) -> None:
        self.current: Optional[PlanFacts] = None
        self._checked: Optional[list] = None  # the batch keys list checked against them
        self._shipped: Any = None  # the plan's fields as put for the workers, once per planned batch

    def planned(self, facts: PlanFacts) -> None:
        self.current, self._checked, self._shipped = facts, None, None

    def shipped(self, make: Callable[[PlanFacts], Any]) -> Any:
        """``make(facts)`` of the batch planned last (the plan's per-row fields put for the workers), made at the
        first call that ships them and reused by every later call of the step (the advantage step's facts carry
        the same fields)."""
        if self._shipped is None:
            self._shipped = make(self.current)
        return self._shipped

    def hand_on(self, facts: PlanFacts) -> None:
        """The advantage step's facts replace the planned ones (the same rows, final loss tokens, its metrics)."""
        self.current = facts

    def of(self, batch: Any) -> PlanFacts:
        """The facts of ``batch``: raises unless it is the batch planned last, rows in the planned order, checked
        once per update (at its first use; its later steps see the same keys list)."""
        if self.current is None:
            raise RuntimeError("no batch was planned: _balance_batch runs before every advantage and update")
        if batch.keys is not self._checked:
            self.current.check(batch.keys)
            self._checked = batch.keys
        return self.current
