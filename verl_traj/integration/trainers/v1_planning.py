"""Planning a v1 batch held in TransferQueue: its layout from the row keys, the ``seq_len`` tags and one count of
loss tokens; the planned batch meta in dispatch order; the plan's per-row fields for the workers (not stored).

A row key is ``{uid}_{session}_{index}`` (:mod:`verl_traj.core.rollout.row_key`): ``uid`` is the prompt (the GRPO group),
``{uid}_{session}`` one trajectory, ``index`` its step. The planner itself is the core's
(:func:`~verl_traj.integration.trainers.step_plan.plan_layout`); these functions move its input out of TransferQueue and
its output to the workers. Each row's loss tokens and prefix block hashes were recorded in its tags where the agent loop wrote
it (:func:`~verl_traj.core.rollout.row_tags.row_fact_tags`), so planning reads no per-token field: :func:`read_layout`
counts the loss tokens from the tags, and with ``traj.prefix_tree`` :func:`read_tree_rows` gives the tree planner
stand-in rows built from the hashes (:mod:`~verl_traj.core.trees.prefix_hashes`), which :func:`plan_row_fields` reuses
with the padding rows' known ids to build each planned micro-batch's tree once per step (the tree facts the workers
rebuild them from on the device in every pass, :mod:`verl_traj.integration.trainers.tree_plan_facts`). A row written
without them (another agent loop) has its ``response_mask`` / ``input_ids`` fetched, and only that row.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
import transfer_queue as tq
from transfer_queue import KVBatchMeta

from verl_traj.core import BatchLayout, MiniBatchPlan, build_layout_from_counts
from verl_traj.core.errors import TrajInputError
from verl_traj.core.keys import MICRO_BATCH_ID, MINI_BATCH_ID
from verl_traj.core.rollout.row_key import parse_row_keys, row_key_order
from verl_traj.core.rollout.row_tags import PREFIX_HASH_TAG, tagged_hashes, tagged_loss_tokens
from verl_traj.core.trees.prefix_hashes import hashed_rows, prefix_block_hashes
from verl_traj.core.trees.token_rows import TokenRows
from verl_traj.core.trees.tree_cost import TreeCostModel
from verl_traj.integration.trainers.tree_plan_facts import row_tree_facts
from verl_traj.integration.trainers.v1_plan_facts import row_loss_tokens

__all__ = ["debug_rows", "dispatch_dp_size", "in_key_order", "ordered_batch", "read_layout", "read_loss_tokens",
           "plan_row_fields", "read_rows", "read_tree_rows", "row_length"]


def dispatch_dp_size(worker_group: Any, mesh: str) -> int:
    """Data-parallel size of a worker group's mesh, as verl's v1 ``_balance_batch`` reads it (cached there)."""
    if mesh not in worker_group._dispatch_info:
        worker_group._dispatch_info[mesh] = worker_group._query_dispatch_info(mesh)
    return max(worker_group._dispatch_info[mesh]) + 1


def in_key_order(batch: KVBatchMeta) -> KVBatchMeta:
    """``batch`` reordered in place by row key (prompt, session, step; numeric): the replay buffer returns rows in
    completion order, and a seeded run must plan the same rows in the same order."""
    batch.reorder(sorted(range(len(batch)), key=lambda i: row_key_order(batch.keys[i])))
    return batch


def _seq_len(batch: KVBatchMeta) -> np.ndarray:
    return np.fromiter((int(t["seq_len"]) for t in batch.tags), dtype=np.int64, count=len(batch))


def read_layout(batch: KVBatchMeta) -> BatchLayout:
    """The planner's input: groups, trajectories and steps from the keys, attended tokens from the ``seq_len`` tags,
    loss tokens from the tags (:func:`read_loss_tokens`)."""
    keys = parse_row_keys(batch.keys)
    return build_layout_from_counts(torch.from_numpy(_seq_len(batch)), torch.from_numpy(read_loss_tokens(batch)),
                                    keys.uid, traj_id=keys.traj_id, step_index=keys.step)


def read_loss_tokens(batch: KVBatchMeta) -> np.ndarray:
    """``[B]`` int64 each row's loss tokens: as the agent loop recorded them, else (a row written without them) from a
    fetch of that row's ``response_mask``."""
    counts = tagged_loss_tokens(batch.tags)
    missing = np.flatnonzero(counts < 0)
    if missing.size:
        mask = tq.kv_batch_get(keys=[batch.keys[i] for i in missing.tolist()], partition_id=batch.partition_id,
                               select_fields=["response_mask"])["response_mask"]
        counts[missing] = row_loss_tokens(mask).numpy()
    return counts


def read_tree_rows(batch: KVBatchMeta) -> TokenRows:
    """The tree planner's rows (:func:`~verl_traj.core.trees.prefix_hashes.hashed_rows`): stand-ins built from each
    row's recorded prefix hashes and its ``seq_len``; a row without them has its ``input_ids`` fetched and hashed
    here. Raises :class:`TrajInputError` (field ``traj_prefix_hashes``) where a row's hashes do not fit its length."""
    hashes, offsets, recorded = tagged_hashes(batch.tags)
    missing = np.flatnonzero(~recorded)
    if missing.size:  # hash the fetched rows and splice them in, each at its row
        extra, extra_offsets = prefix_block_hashes(read_rows(batch, [batch.keys[i] for i in missing.tolist()]))
        counts = np.diff(offsets)
        counts[missing] = np.diff(extra_offsets)
        start = offsets[:-1].copy()
        start[missing] = hashes.size + extra_offsets[:-1]
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        at = np.arange(int(offsets[-1]), dtype=np.int64) + np.repeat(start - offsets[:-1], counts)
        hashes = np.concatenate([hashes, extra])[at]
    try:
        return hashed_rows(hashes, offsets, _seq_len(batch))
    except ValueError as e:
        raise TrajInputError(f"{PREFIX_HASH_TAG}: {e}. Fix: leave the rows as the agent loop wrote them, or drop the "
                             f"{PREFIX_HASH_TAG} tag of a row rewritten after it.", field=PREFIX_HASH_TAG) from e


def read_rows(batch: KVBatchMeta, keys: Optional[list[str]] = None) -> TokenRows:
    """Every row's attended token ids (``traj.prefix_tree``: the planner costs units in tree tokens), from one fetch
    of ``input_ids`` (stored unpadded, one nested row each); ``keys``: only those rows of ``batch``'s partition."""
    keys = batch.keys if keys is None else keys
    if not keys:
        return TokenRows(np.zeros(0, np.int64), np.zeros(1, np.int64))
    ids = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=["input_ids"])["input_ids"]
    if not ids.is_nested:  # rows of one length as one [K, L] tensor (verl's list_of_dict_to_tensordict makes one)
        return TokenRows.of_flat(ids.reshape(-1), np.full(ids.shape[0], ids.shape[-1]))
    return TokenRows.of_flat(ids.values(), ids.offsets().diff())


def pad_rows(plan: MiniBatchPlan, pad_ids: np.ndarray) -> TokenRows:
    """The padding rows the plan wrote (``plan.order < 0``), each ``pad_ids`` (one padding row's attended ids, as
    :func:`~verl_traj.integration.trainers.v1_padding.padding_ids` writes them): the trees take the source rows read
    for planning by ``plan.order`` and these, with nothing fetched."""
    count = int((plan.order < 0).sum())
    return TokenRows(np.tile(np.asarray(pad_ids, dtype=np.int64), count),
                     np.arange(count + 1, dtype=np.int64) * len(pad_ids))


def ordered_batch(batch: KVBatchMeta, plan: MiniBatchPlan, pad_keys: list[str], pad_tags: list[dict]) -> KVBatchMeta:
    """A new meta: ``batch``'s keys and tags with the padding rows appended, in the plan's rank-major order
    (``plan.order``: source row per planned row, ``-1`` for padding; padding rows fill those slots in order). The
    prefix hashes are left out of its tags: planning has read them, and the meta rides along with every call to the
    workers (about 7 KB a row of 14K tokens; the controller keeps them)."""
    keys = batch.keys + pad_keys
    tags = [{k: v for k, v in t.items() if k != PREFIX_HASH_TAG} for t in batch.tags] + pad_tags
    order = plan.order.numpy().copy()
    pads = np.flatnonzero(order < 0)
    order[pads] = len(batch) + np.arange(pads.size)
    return KVBatchMeta(keys=[keys[i] for i in order], tags=[tags[i] for i in order], partition_id=batch.partition_id,
                       fields=batch.fields, extra_info=batch.extra_info)


def plan_row_fields(plan: MiniBatchPlan, rows: Optional[TokenRows] = None, tree_cost: Optional[TreeCostModel] = None,
                    pad_ids: Optional[np.ndarray] = None) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The plan's per-row worker fields, dispatch order: ``mini_batch_id`` and ``micro_batch_id`` (``[B]`` int64);
    with a prefix-tree plan also each planned micro-batch's tree facts (``TREE_SEGMENT`` ``[B, 3]``, ``TREE_SIZE``
    ``[B]``) from the planned rows (``rows``: the source rows :func:`read_tree_rows` gave the planner; ``pad_ids``: one
    padding row's ids; ``tree_cost`` decides which micro-batches forward as trees). Nothing is stored: they travel
    with each call that reads them (:func:`~verl_traj.integration.trainers.v1_updates.rank_blocks`). Returns them and the trees'
    metrics (``actor/tree_share``)."""
    fields, trees = {MINI_BATCH_ID: plan.mini_batch_id, MICRO_BATCH_ID: plan.micro_batch_id}, {"actor/tree_share": 0.0}
    if plan.spec.prefix_tree:
        if rows is None or tree_cost is None or pad_ids is None:
            raise TrajInputError("plan_row_fields: a prefix-tree plan needs the rows it was planned from, the tree "
                                 "cost model and the padding rows' ids (rows, tree_cost or pad_ids is None). Fix: pass "
                                 "read_tree_rows(batch), the update's PlanSettings.tree_cost and "
                                 "padding_ids(eos, pad_row_tokens).", field="rows")
        tree_fields, trees = row_tree_facts(rows, pad_rows(plan, pad_ids), plan, tree_cost)
        fields.update(tree_fields.items())
    return fields, trees


def row_length(batch: KVBatchMeta) -> torch.Tensor:
    """``[B]`` int64 each row's attended tokens from its ``seq_len`` tag (padding rows' included)."""
    return torch.from_numpy(_seq_len(batch))


def debug_rows(batch: KVBatchMeta, plan: MiniBatchPlan, layout: BatchLayout) -> dict[str, list]:
    """The per-row lists of the debug dump (:func:`~verl_traj.integration.trainers.step_plan.debug_dump`), dispatch
    order."""
    src = plan.order.clamp(min=0)
    keys = parse_row_keys(batch.keys)
    return {"uid": keys.uid.tolist(), "traj_id": keys.traj_id.tolist(),
            "loss_tokens": torch.where(plan.is_padding, 0, layout.num_loss_tokens[src]).tolist(),
            "response_length": [int(t["response_len"]) for t in batch.tags],
            "attention_length": [int(t["seq_len"]) for t in batch.tags]}
