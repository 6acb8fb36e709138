"""The actor's, reference's and critic's passes on prefix trees (``traj.prefix_tree``, issue 29, item 3): what a
worker does with a batch the trainer marked ``prefix_tree``.

The trainer marks each pass of a planned batch (the non-tensor :data:`~verl_traj.core.keys.TREE_KEY`:
v1 puts it in the call's ``extra_info``, since verl rebuilds the meta between passes; v0 in the batch's
``meta_info``, which every pass carries). A verl_traj worker that receives a marked batch runs the pass inside
:func:`~verl_traj.integration.tree.tree_forward.tree_forward` on its engine, on the plan's micro-batches:

* the updates (``train_mini_batch``, actor and critic): the plan's mini-batches and micro-batches as for every
  planned update (:mod:`verl_traj.integration.workers.engine_workers`), each micro-batch forwarded as one tree;
* the old-log-prob, reference and value passes (``infer_batch``): the same planned micro-batches (``mini_batch_id``,
  ``micro_batch_id``), not verl's own cut, so both log-probs of the PPO ratio take one numeric path (the same trees,
  the same kernels), and a group's rows share their prompt here too.

A marked pass is a contract like the planned update: a marked batch without the plan's ids or its tree facts
(:mod:`verl_traj.integration.tree.tree_plan_facts`: the trees are planned once per step on the driver, shipped with the plan and rebuilt on the
device in each pass) raises, and after the pass every micro-batch that ran must have been forwarded as a tree
(:func:`check_all_tree`), else it raises -- a tree pass never falls back to the per-row forward in silence.

What the passes record is bounded: a pass's log lives as long as the pass (an update's until its metrics are read);
the inference passes add to the worker's :class:`~verl_traj.integration.tree.tree_log.TreeTotals` (two numbers), which its next update reports
and resets on every rank.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id

from verl_traj.core.errors import TrajInputError
from verl_traj.core.keys import MICRO_BATCH_ID, MINI_BATCH_ID
from verl_traj.core.keys import TREE_KEY
from verl_traj.integration.tree.tree_forward import tree_forward
from verl_traj.integration.tree.tree_log import TreeForwardLog, TreeTotals
from verl_traj.integration.tree.tree_plan_facts import require_tree_facts

__all__ = ["check_all_tree", "tree_marked", "tree_metrics", "tree_pass"]


def tree_marked(data: TensorDict) -> bool:
    """Whether the trainer marked this batch for the prefix-tree forward; a marked batch must carry the plan's ids
    and tree facts."""
    if not bool(tu.get_non_tensor_data(data=data, key=TREE_KEY, default=False)):
        return False
    missing = [k for k in (MINI_BATCH_ID, MICRO_BATCH_ID) if k not in data.keys()]
    if missing:
        raise TrajInputError(
            f"a batch marked {TREE_KEY!r} lacks the plan's {missing[0]!r}: its trees are the plan's micro-batches "
            f"(received: {sorted(data.keys())}). Fix: name the plan's ids in the batch meta's fields (verl_traj's "
            "trainer does in _balance_batch; a subclass that rebuilds the meta must keep them).", field=missing[0])
    require_tree_facts(data.keys())
    return True


def check_all_tree(log: TreeForwardLog, micro_batches_run: int, what: str) -> None:
    """Raise unless every one of the ``micro_batches_run`` micro-batches of a marked pass ran as a tree."""
    if len(log.tree_tokens) != micro_batches_run:
        raise RuntimeError(
            f"{what}: {micro_batches_run} micro-batches ran but {len(log.tree_tokens)} as prefix trees: the engine "
            "forwarded some without the tree (an engine whose forward does not go through prepare_model_inputs?). "
            "traj.prefix_tree needs verl's FSDP engine; set traj.prefix_tree=false for this engine.")


@contextlib.contextmanager
def tree_pass(engine: Any, counts: Callable[[], int], what: str,
              into: Optional[TreeTotals] = None) -> Iterator[TreeForwardLog]:
    """Within: ``engine`` forwards every micro-batch as a tree; on exit (no error) the pass's log is settled (its one
    device read: :meth:`~verl_traj.integration.tree.tree_log.TreeForwardLog.settle`) and ``counts()`` micro-batches (the planned ones the pass
    ran) must all have been trees (:func:`check_all_tree`). ``into``: totals the pass is added to (a worker's
    log-prob / value passes, which its next update reports)."""
    with tree_forward(engine) as log:
        yield log
    check_all_tree(log, counts(), what)
    if into is not None:
        into.add(log)


def tree_metrics(log: TreeForwardLog, infer: TreeTotals, dp_group: Any = None) -> dict[str, list]:
    """Per update, summed over the data-parallel ranks (one all-reduce) and all epochs: row tokens, tree tokens (what
    the model forwarded, verl's tail padding aside), branch copies, tree micro-batches (per rank: their mean), row
    tokens per tree token, the (query, key) pairs of the trees' attention and of the per-row attention over the same
    rows; and the micro-batches and tree tokens of this worker's inference passes (``infer``, taken from its totals:
    the actor's old log-probs, the critic's values) since its last update."""
    local = [sum(log.row_tokens), sum(log.tree_tokens), sum(log.branch_copies), len(log.tree_tokens),
             infer.micro_batches, infer.tree_tokens, sum(log.attention_pairs), sum(log.row_attention_pairs)]
    totals = torch.tensor(local, dtype=torch.float64, device=get_device_id())
    ranks = 1
    if dp_group is not None and torch.distributed.is_initialized():
        torch.distributed.all_reduce(totals, group=dp_group)
        ranks = torch.distributed.get_world_size(dp_group)
    rows, tree, copies, micro, infer_micro, infer_tree, pairs, row_pairs = totals.tolist()
    return {"tree_row_tokens": [rows], "tree_tokens": [tree], "tree_branch_copies": [copies],
            "tree_attention_pairs": [pairs], "tree_row_attention_pairs": [row_pairs],
            "tree_micro_batches": [micro / ranks], "tree_row_tokens_per_tree_token": [rows / max(tree, 1.0)],
            "tree_infer_micro_batches": [infer_micro / ranks], "tree_infer_tokens": [infer_tree]}
