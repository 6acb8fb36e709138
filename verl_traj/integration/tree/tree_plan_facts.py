"""The plan's prefix-tree facts (issue 40, item 3): built by the trainer where the token ids are on the host, shipped
with the plan as per-row fields, read by the workers' tree forward (:mod:`verl_traj.integration.tree.tree_forward`) in every pass and epoch.

Fields (written with the plan's ids, next to ``mini_batch_id`` / ``micro_batch_id``):

* :data:`TREE_INDEX` -- each row token's index in its micro-batch's tree
  (:func:`~verl_traj.core.tree_facts.micro_batch_tree_facts`): v0 ``[B, W]`` int32, row ``r``'s token ``j`` at column
  ``j`` (``-1`` past its end; ``W`` the longest row); v1 nested ``[B, L_r]`` (TransferQueue stores rows unpadded);
* :data:`TREE_SIZE` -- ``[B]`` int64, the tree tokens ``N`` of the row's micro-batch.

A micro-batch is the rows of one rank's block with one (``mini_batch_id``, ``micro_batch_id``): exactly the rows
the workers' planned micro-batches hold (:mod:`verl_traj.integration.workers.planned_update`). The worker reads ``N`` from the micro-batch's host
copy while cutting it (:func:`micro_batch_tree_sizes`) and carries it as the micro-batch's non-tensor
:data:`TREE_SIZE_KEY`; the tree itself is built on the device (:func:`~verl_traj.core.tree_facts.tree_from_facts`).
A marked pass without these fields raises (:func:`require_tree_facts`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from verl_traj.core.errors import TrajInputError
from verl_traj.core.keys import TREE_INDEX, TREE_SIZE, TREE_SIZE_KEY
from verl_traj.core.tree_facts import TreeFacts, plan_sources, planned_tree_facts

__all__ = ["TREE_INDEX", "TREE_SIZE", "TREE_SIZE_KEY", "dense_tree_facts", "micro_batch_tree_sizes",
           "nested_tree_facts", "plan_tree_facts", "require_tree_facts"]


def plan_tree_facts(rows: Any, pad_rows: Any, plan: Any) -> tuple[TreeFacts, np.ndarray]:
    """The planned micro-batches' tree facts in the planner's rows' order and each planned row's source in them
    (:func:`~verl_traj.core.tree_facts.plan_sources`): ``rows`` the planner's rows, ``pad_rows`` the padding rows the
    plan wrote (dispatch order); a micro-batch is the rows of one (rank, mini-batch, micro-batch)."""
    micro = plan.micro_batch_id.numpy()
    width = int(micro.max(initial=0)) + 1
    part = (plan.rank.numpy() * plan.num_mini_batches + plan.mini_batch_id.numpy()) * width + micro
    sources, source = plan_sources(rows, plan.order.numpy(), pad_rows)
    return planned_tree_facts(sources, source, part), source


def dense_tree_facts(rows: Any, pad_rows: Any, plan: Any) -> dict[str, torch.Tensor]:
    """v0's fields (a ``DataProto`` holds ``[B, ...]`` tensors), dispatch order: ``TREE_INDEX`` ``[B, W]`` int32
    (``-1`` past a row's end) and ``TREE_SIZE`` ``[B]`` int64; the source rows' dense facts, rows gathered once."""
    facts, source = plan_tree_facts(rows, pad_rows, plan)
    lengths = np.diff(facts.offsets)
    width = max(int(lengths.max(initial=0)), 1)
    dense = np.full((lengths.size, width), -1, dtype=np.int32)
    dense[np.arange(width)[None, :] < lengths[:, None]] = facts.index  # row-major: each row's tokens, left-aligned
    return {TREE_INDEX: torch.from_numpy(dense[source]), TREE_SIZE: torch.from_numpy(facts.size[source])}


def nested_tree_facts(rows: Any, pad_rows: Any, plan: Any) -> TensorDict:
    """v1's fields (TransferQueue keeps rows unpadded), dispatch order: ``TREE_INDEX`` nested ``[B, L_r]`` int32 and
    ``TREE_SIZE`` ``[B]`` int64, as a TensorDict of ``B`` rows."""
    facts, source = plan_tree_facts(rows, pad_rows, plan)
    lengths = np.diff(facts.offsets)[source]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    at = np.arange(int(offsets[-1]), dtype=np.int64)
    at += np.repeat(facts.offsets[source] - offsets[:-1], lengths)
    index = torch.nested.nested_tensor_from_jagged(torch.from_numpy(facts.index[at]), torch.from_numpy(offsets))
    return TensorDict({TREE_INDEX: index, TREE_SIZE: torch.from_numpy(facts.size[source])}, batch_size=[source.size])


def require_tree_facts(keys: Any) -> None:
    """Raise :class:`TrajInputError` naming the first tree fact a marked pass's batch lacks."""
    missing = [k for k in (TREE_INDEX, TREE_SIZE) if k not in set(keys)]
    if missing:
        raise TrajInputError(
            f"a batch marked for the prefix-tree forward lacks the plan's {missing[0]!r} (received: {sorted(keys)}): "
            "the workers build each micro-batch's tree from the facts the trainer ships with the plan, never from "
            "token ids copied back to the host. Fix: plan the batch with verl_traj's trainer and traj.prefix_tree=true "
            "(it writes them next to mini_batch_id); a subclass that rebuilds the batch must keep them.",
            field=missing[0])


def micro_batch_tree_sizes(data: TensorDict, inverse: torch.Tensor, firsts: torch.Tensor) -> list[int]:
    """Each planned micro-batch's tree tokens from the batch's host copy: ``inverse`` ``[b]`` micro-batch of each
    row, ``firsts`` ``[k]`` a row of each. Raises :class:`TrajInputError` (field ``TREE_SIZE``) when the rows of a
    micro-batch disagree (the batch was cut or reordered after planning)."""
    size = data[TREE_SIZE].cpu()  # a no-op: verl's workers hold a batch on the host until forward_step moves it
    sizes = size[firsts]
    if not torch.equal(sizes[inverse], size):
        raise TrajInputError(
            f"the rows of a planned micro-batch carry different {TREE_SIZE!r} ({size.tolist()[:16]} for micro-batches "
            f"{inverse.tolist()[:16]}): the batch was re-cut or reordered after the trainer planned its trees. Fix: "
            "hand the workers the planned batch unmodified.", field=TREE_SIZE)
    return sizes.tolist()
