"""The plan's prefix-tree facts (issue 40, item 3): built by the trainer where the token ids are on the host, shipped
with the plan as per-row fields, read by the workers' tree forward (:mod:`verl_traj.integration.tree.tree_forward`) in
every pass and epoch.

Fields (shipped with the plan's ids, next to ``mini_batch_id`` / ``micro_batch_id``; the same for both trainers):

* :data:`~verl_traj.core.keys.TREE_SEGMENT` -- ``[B, 3]`` int64, each row's segment in its micro-batch's tree
  (:func:`~verl_traj.core.trees.tree_facts.micro_batch_tree_facts`: rank, start, first tree token), from which the
  worker computes every row token's tree index (:func:`~verl_traj.core.trees.tree_facts.segment_tree_index`);
* :data:`~verl_traj.core.keys.TREE_SIZE` -- ``[B]`` int64, the tree tokens ``N`` of the row's micro-batch.

A micro-batch is the rows of one rank's block with one (``mini_batch_id``, ``micro_batch_id``): exactly the rows
the workers' planned micro-batches hold (:mod:`verl_traj.integration.workers.planned_update`). The worker reads ``N``
from the micro-batch's host copy while cutting it
(:func:`~verl_traj.core.kernels.tree_pass.micro_batch_tree_sizes`) and carries it as the micro-batch's non-tensor
:data:`~verl_traj.core.keys.TREE_SIZE_KEY`; the tree itself is built on the device
(:func:`~verl_traj.core.trees.tree_facts.tree_from_facts`). A marked pass without these fields raises
(:func:`~verl_traj.core.kernels.tree_pass.require_tree_facts`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from verl_traj.core.keys import TREE_SEGMENT, TREE_SIZE
from verl_traj.core.trees.tree_cost import TreeCostModel
from verl_traj.core.trees.tree_facts import TreeFacts, plan_sources, planned_tree_facts

__all__ = ["plan_tree_facts", "row_tree_facts", "tree_choice"]


def tree_choice(facts: TreeFacts, source: np.ndarray, part: np.ndarray, cost: TreeCostModel,
                cap: Any) -> tuple[TreeFacts, dict[str, float]]:
    """The facts with ``size`` 0 on the rows of every micro-batch that forwards as rows (the cost model's decision
    per micro-batch, :mod:`verl_traj.core.trees.tree_cost`), and the step's ``actor/tree_share`` (micro-batches as
    trees) and ``actor/tree_token_share`` (their row tokens' share)."""
    _, inverse = np.unique(part, return_inverse=True)
    row_tokens = np.bincount(inverse, weights=np.diff(facts.offsets)[source])
    tree_tokens = np.zeros(row_tokens.size)
    tree_tokens[inverse] = facts.size[source]
    trees = cost.trees(tree_tokens, row_tokens, cap)
    size = facts.size.copy()
    size[source] = np.where(trees[inverse], facts.size[source], 0)
    share = float(trees.mean()) if trees.size else 0.0
    total = float(row_tokens.sum())
    return (TreeFacts(facts.segment, facts.offsets, size),
            {"actor/tree_share": share,
             "actor/tree_token_share": float(row_tokens[trees].sum()) / total if total > 0 else share})


def plan_tree_facts(rows: Any, pad_rows: Any, plan: Any,
                    cost: TreeCostModel) -> tuple[TreeFacts, np.ndarray, dict[str, float]]:
    """The planned micro-batches' tree facts in the planner's rows' order, each planned row's source in them
    (:func:`~verl_traj.core.trees.tree_facts.plan_sources`) and the trees' metrics: ``rows`` the planner's rows,
    ``pad_rows`` the padding rows the plan wrote (dispatch order); a micro-batch is the rows of one (rank, mini-batch,
    micro-batch); a micro-batch the cost model sends to rows has tree size 0 (:func:`tree_choice`)."""
    micro = plan.micro_batch_id.numpy()
    width = int(micro.max(initial=0)) + 1
    part = (plan.rank.numpy() * plan.num_mini_batches + plan.mini_batch_id.numpy()) * width + micro
    sources, source = plan_sources(rows, plan.order.numpy(), pad_rows)
    facts, metrics = tree_choice(planned_tree_facts(sources, source, part), source, part, cost,
                                 plan.spec.micro_batch_max_tokens)
    return facts, source, metrics


def row_tree_facts(rows: Any, pad_rows: Any, plan: Any,
                   cost: TreeCostModel) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The plan's per-row tree fields, dispatch order, for both trainers: ``TREE_SEGMENT`` ``[B, 3]`` int64 and
    ``TREE_SIZE`` ``[B]`` int64 (a few ints a row, whatever the rows' lengths); and the trees' metrics."""
    facts, source, metrics = plan_tree_facts(rows, pad_rows, plan, cost)
    return {TREE_SEGMENT: torch.from_numpy(facts.segment[source]),
            TREE_SIZE: torch.from_numpy(facts.size[source])}, metrics
