"""One planned update on v1 (actor or critic), as a contract with the workers.

Before verl dispatches an update, the driver stores the per-row fields the planned update needs and names them:

* ``loss_weight`` (:meth:`~verl_traj.integration.config.update_spec.LossSpec.weights_from_counts`, from the plan's facts and
  each row's final loss-token count: no ``[B, R]`` mask is fetched here), and for GSPO at trajectory scope with a
  trajectory of several rows ``ratio_group``, are written to TransferQueue;
* every planned field (:func:`~verl_traj.core.keys.planned_update_fields`: ``mini_batch_id`` and ``micro_batch_id``
  stored by ``_balance_batch``, plus the above) is named in the batch meta's field list when it has one: the workers
  fetch exactly the fields ``KVBatchMeta.fields`` names (``None``: every stored field);
* the update's ``extra_info`` (non-tensor data on the worker) carries the planned field names
  (:data:`~verl_traj.core.keys.PLANNED_FIELDS`), the critic's mini-batch union and that the old log-probs came from
  the update's starting parameters (:data:`~verl_traj.core.keys.OLD_LOG_PROBS_AT_START`), for the call only; the worker
  checks every named field arrived (:func:`~verl_traj.integration.workers.engine_workers.check_planned_update`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import transfer_queue as tq
from tensordict import TensorDict

from verl_traj.core.keys import (CRITIC_UNION_KEY, LOSS_WEIGHT, OLD_LOG_PROBS_AT_START, PLANNED_FIELDS, RATIO_GROUP,
                                 RATIO_IN_LOSS, planned_update_fields)
from verl_traj.integration.config.update_spec import LossSpec
from verl_traj.integration.trainers.v1_plan_facts import PlanFacts

__all__ = ["extra_info", "name_fields", "planned_update", "put_update_fields"]


def name_fields(batch: Any, fields: tuple[str, ...]) -> None:
    """Add ``fields`` to ``batch.fields`` (order kept, no duplicates); nothing when the meta names no fields (the
    workers then fetch every stored field)."""
    if batch.fields is not None:
        batch.fields = list(dict.fromkeys([*batch.fields, *fields]))


def put_update_fields(batch: Any, facts: PlanFacts, loss: LossSpec, ratio_groups: bool = False) -> tuple[str, ...]:
    """Store ``loss_weight`` (``[B]`` float32) and with ``ratio_groups`` ``ratio_group`` (``[B]`` int64, each row's
    trajectory) for every row of ``batch`` (checked to be the planned rows), name every planned field in the meta;
    returns the planned field names."""
    facts.check(batch.keys)
    fields = {LOSS_WEIGHT: loss.weights_from_counts(facts.loss_tokens, facts.mini_batch_id, facts.traj_index,
                                                    facts.is_padding)}
    if ratio_groups:
        fields[RATIO_GROUP] = facts.traj_index.clone()
    tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                    fields=TensorDict(fields, batch_size=[len(batch)]))
    planned = planned_update_fields(ratio_groups)
    name_fields(batch, planned)
    return planned


@contextlib.contextmanager
def planned_update(batch: Any, facts: PlanFacts, loss: LossSpec, *, ratio_groups: bool = False,
                   union: int = 1, old_log_probs_at_start: bool = False,
                   ratio_in_loss: bool = False) -> Iterator[tuple[str, ...]]:
    """For one verl update call: the update's fields stored and named (:func:`put_update_fields`), its
    ``extra_info`` carrying the planned field names, (``union > 1``) the critic's mini-batch union and whether the old
    log-probs came from the update's starting parameters (the trainer knows: ``TrajV1Mixin._old_log_probs_at_start``);
    the keys removed again on exit, also on error. Yields the planned field names."""
    planned = put_update_fields(batch, facts, loss, ratio_groups)
    extra = {PLANNED_FIELDS: ",".join(planned), **({CRITIC_UNION_KEY: union} if union > 1 else {}),
             OLD_LOG_PROBS_AT_START: bool(old_log_probs_at_start), **({RATIO_IN_LOSS: True} if ratio_in_loss else {})}
    with extra_info(batch, extra):
        yield planned


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
