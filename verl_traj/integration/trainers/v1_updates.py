"""One planned update on v1 (actor or critic): the contract both trainers build
(:mod:`~verl_traj.integration.trainers.update_contract`), moved into v1's data path.

* its per-row fields (``loss_weight`` from each row's final loss-token count: no ``[B, R]`` mask is fetched here;
  ``ratio_group`` where GSPO needs it) are written to TransferQueue;
* every planned field (``mini_batch_id`` and ``micro_batch_id`` stored by ``_balance_batch``, plus the above) is named
  in the batch meta's field list when it has one: the workers fetch exactly the fields ``KVBatchMeta.fields`` names
  (``None``: every stored field);
* its markers travel in the meta's ``extra_info`` (non-tensor data on the worker), for the call only; the worker
  checks every named field arrived (:func:`~verl_traj.integration.workers.planned_update.check_planned_update`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import transfer_queue as tq
from tensordict import TensorDict

from verl_traj.integration.config.update_spec import UpdateSpec
from verl_traj.integration.trainers.update_contract import UpdateContract, loss_of, update_contract
from verl_traj.integration.trainers.v1_plan_facts import PlanFacts

__all__ = ["extra_info", "name_fields", "planned_update", "put_update_fields"]


def name_fields(batch: Any, fields: tuple[str, ...]) -> None:
    """Add ``fields`` to ``batch.fields`` (order kept, no duplicates); nothing when the meta names no fields (the
    workers then fetch every stored field)."""
    if batch.fields is not None:
        batch.fields = list(dict.fromkeys([*batch.fields, *fields]))


def put_update_fields(batch: Any, facts: PlanFacts, spec: UpdateSpec, role: str, local_step: int = 0) -> UpdateContract:
    """Store the ``role`` update's per-row fields
    (:func:`~verl_traj.integration.trainers.update_contract.update_contract`: ``loss_weight`` from each row's final
    loss-token count, ``ratio_group`` where GSPO needs it) for every row of ``batch`` (checked to be the planned rows)
    and name every planned field in the meta; returns the contract."""
    facts.check(batch.keys)
    weights = loss_of(spec, role).weights_from_counts(facts.loss_tokens, facts.mini_batch_id, facts.traj_index,
                                                       facts.is_padding)
    contract = update_contract(spec, role, weights, facts.traj_index, facts.is_padding, all_atomic=facts.all_atomic,
                               local_step=local_step)
    tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                    fields=TensorDict(contract.fields, batch_size=[len(batch)]))
    name_fields(batch, contract.planned)
    return contract


@contextlib.contextmanager
def planned_update(batch: Any, facts: PlanFacts, spec: UpdateSpec, role: str,
                   local_step: int = 0) -> Iterator[UpdateContract]:
    """For one verl update call: the contract's fields stored and named (:func:`put_update_fields`), its markers in
    the meta's ``extra_info``, removed again on exit, also on error. Yields the contract."""
    contract = put_update_fields(batch, facts, spec, role, local_step)
    with extra_info(batch, contract.markers):
        yield contract


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
