"""A planned call on v1 (an update of the actor or the critic, or a prefix-tree pass): the contract both trainers
build (:mod:`~verl_traj.integration.trainers.update_contract`), moved into v1's data path.

* the per-row fields: the plan's (``mini_batch_id``, ``micro_batch_id``, the prefix-tree facts:
  :attr:`~verl_traj.integration.trainers.v1_plan_facts.PlanFacts.row_fields`) and an update's (``loss_weight`` from
  each row's final loss-token count, no ``[B, R]`` mask fetched; ``ratio_group`` where GSPO needs it) travel with the
  call, each rank's block in Ray's object store (:func:`rank_blocks`, below: the plan's once a step, an update's
  own once a call); nothing is written to TransferQueue;
* its markers travel in the meta's ``extra_info`` (non-tensor data on the worker), for the call only; the worker
  takes its block, checks it is its rows (:func:`~verl_traj.integration.workers.planned_update.take_row_fields`), then
  that every planned field arrived (:func:`~verl_traj.integration.workers.planned_update.check_planned_update`).

Why the fields travel with the call. verl cuts a call's ``KVBatchMeta`` into one equal chunk per data-parallel rank,
in order, and each worker fetches its chunk's stored fields. The plan's per-row fields are born on the driver each
step and read only by the workers. Stored as TransferQueue fields they cost a put of every row every step: about
70 us a row whatever the size (``scripts/bench_v1_driver.py``: 7.3 s of ids and 13.7 s with the tree facts at 10^5
rows, more than stock's whole ``_balance_batch``), and one more put per update. Instead the rows are laid out
rank-major in equal blocks (checked), so rank ``r``'s chunk is block ``r``: each block of the plan's fields, with
:data:`~verl_traj.core.keys.ROW_LENGTH` (each row's attended tokens, the worker's check), goes into the object store
once a step, at the first call that ships it (``dp`` puts whatever the row count; every later pass and update of the
step reuses them), an update's loss weights once a call, and the call's meta carries the references
(:class:`RowFieldRefs`, non-tensor data :data:`~verl_traj.core.keys.ROW_FIELDS`) for that call only. Each rank
fetches only its blocks.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Any, Iterator, Mapping

import ray
import torch

from verl_traj.core.keys import ROW_FIELDS, ROW_LENGTH
from verl_traj.integration.config.update_spec import UpdateSpec
from verl_traj.integration.trainers.update_contract import UpdateContract, loss_of, update_contract
from verl_traj.integration.trainers.v1_plan_facts import PlanFacts, StepFacts

__all__ = ["RowFieldRefs", "extra_info", "plan_blocks", "planned_pass", "planned_update", "rank_blocks", "update_fields"]


@dataclass(frozen=True)
class RowFieldRefs:
    """One call's per-row fields: ``parts``, each a tuple of ``dp`` Ray objects (rank ``r``'s rows: a dict of
    ``[b, ...]`` tensors); rank ``r`` merges entry ``r`` of every part. The first part is the plan's
    (:func:`plan_blocks`, with :data:`~verl_traj.core.keys.ROW_LENGTH`), put once a step; an update adds its own."""

    parts: tuple


def rank_blocks(fields: Mapping[str, torch.Tensor], rank: torch.Tensor, dp: int) -> tuple:
    """``fields`` (``[B, ...]`` tensors, dispatch order) cut into the ``dp`` ranks' blocks, each put in the object
    store once. ``rank`` ``[B]``: the plan's rank of each row, which must be ``dp`` equal blocks in order (verl's chunk
    of the meta: equal pieces in order)."""
    b = int(rank.numel())
    per = b // dp if dp > 0 else 0
    if b % max(dp, 1) or not torch.equal(rank.long(), torch.arange(dp).repeat_interleave(per)):
        raise RuntimeError(f"the plan's {b} rows are not {dp} equal rank-major blocks (rank of each row: "
                           f"{rank.tolist()[:16]}...): verl cuts a call's batch into equal chunks in order, so the "
                           "workers would read other ranks' plan fields. The planner pads every rank to one row count.")
    return tuple(ray.put({k: v[r * per:(r + 1) * per].contiguous() for k, v in fields.items()}) for r in range(dp))


def plan_blocks(facts: PlanFacts, dp: int) -> tuple:
    """The plan's per-row worker fields and each row's attended tokens (the workers' check), by rank."""
    return rank_blocks({**facts.row_fields, ROW_LENGTH: facts.row_length}, facts.rank, dp)


def update_fields(facts: PlanFacts, spec: UpdateSpec, role: str, local_step: int = 0) -> UpdateContract:
    """The ``role`` update's contract (:func:`~verl_traj.integration.trainers.update_contract.update_contract`:
    ``loss_weight`` from each row's final loss-token count, ``ratio_group`` where GSPO needs it) for the planned
    rows."""
    weights = loss_of(spec, role).weights_from_counts(facts.loss_tokens, facts.mini_batch_id, facts.traj_index,
                                                       facts.is_padding)
    return update_contract(spec, role, weights, facts.traj_index, facts.is_padding, all_atomic=facts.all_atomic,
                           local_step=local_step)


@contextlib.contextmanager
def planned_update(batch: Any, step: StepFacts, spec: UpdateSpec, role: str, dp: int,
                   local_step: int = 0) -> Iterator[UpdateContract]:
    """For one verl update call on ``dp`` data-parallel ranks of ``batch`` (the planned batch: ``step.of`` checks its
    keys): the plan's per-row fields (put once a step) and the contract's shipped with it, its markers in the meta's
    ``extra_info``; removed again on exit, also on error. Yields the contract."""
    facts = step.of(batch)
    contract = update_fields(facts, spec, role, local_step)
    refs = RowFieldRefs((step.shipped(partial(plan_blocks, dp=dp)), rank_blocks(contract.fields, facts.rank, dp)))
    with extra_info(batch, {**contract.markers, ROW_FIELDS: refs}):
        yield contract


@contextlib.contextmanager
def planned_pass(batch: Any, step: StepFacts, markers: dict, dp: int) -> Iterator[None]:
    """For one verl inference call (log-probs, reference, values) on ``dp`` ranks of a batch whose passes run the
    plan's micro-batches (``markers``: :func:`~verl_traj.integration.trainers.update_contract.pass_markers`): the
    plan's per-row fields (put once a step) shipped with it, the markers in ``extra_info``; removed on exit, also on
    error."""
    step.of(batch)
    with extra_info(batch, {**markers, ROW_FIELDS: RowFieldRefs((step.shipped(partial(plan_blocks, dp=dp)),))}):
        yield


@contextlib.contextmanager
def extra_info(batch: Any, extra: dict) -> Iterator[None]:
    """``batch.extra_info`` (non-tensor data on the worker) carrying ``extra`` for one verl call; removed on exit,
    also on error."""
    batch.extra_info.update(extra)
    try:
        yield
    finally:
        for key in extra:
            batch.extra_info.pop(key, None)
