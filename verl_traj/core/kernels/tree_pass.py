"""A worker's pass on prefix trees, what it checks and records (issue 29, item 3; issue 40, item 4): the pure part.

The trainer marks each pass of a planned batch (the non-tensor :data:`~verl_traj.core.keys.TREE_KEY`); a verl_traj
worker forwards every planned micro-batch of a marked pass as one tree
(:mod:`verl_traj.integration.tree.tree_forward`). A marked pass is a contract like the planned update: a batch without
the plan's ids or its tree facts (:func:`check_marked`), micro-batches whose rows disagree on their tree's size
(:func:`micro_batch_tree_sizes`), or a pass in which some micro-batch ran without its tree (:func:`check_all_tree`)
raises, naming the field -- a tree pass never falls back to the per-row forward in silence.

What a pass records is bounded: :class:`TreeForwardLog` lives as long as the pass (an update's until its metrics are
read); the inference passes add to the worker's :class:`TreeTotals` (two numbers), which its next update reports.
Every device count of a pass is read once, when it ends (:meth:`TreeForwardLog.settle`), never per micro-batch.

Pure module (torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from verl_traj.core.errors import TrajInputError
from verl_traj.core.keys import MICRO_BATCH_ID, MINI_BATCH_ID, TREE_SEGMENT, TREE_KEY, TREE_SIZE
from verl_traj.core.trees.tree_facts import DeviceTree

__all__ = ["TreeForwardLog", "TreeTotals", "check_all_tree", "check_marked", "micro_batch_tree_sizes",
           "require_tree_facts", "tree_metric_totals", "tree_metrics_of"]

_COUNTED = ("branch_copies", "attention_pairs", "row_attention_pairs")  # device counts, host ints once settled
_CHECK_FIX = {"tree_index": (TREE_SEGMENT, "the plan's tree facts do not reproduce these rows (the batch was changed or "
                             "re-cut after planning): hand the workers the planned batch unmodified"),
              "position_ids": ("position_ids", "a row's position ids are not 0..L-1 (a tree token's position is its "
                               "depth): forward these rows without the tree"),
              "temperature": ("temperature", "give the rows of a tree micro-batch one temperature (shared tokens "
                              "serve several rows)")}


@dataclass
class TreeForwardLog:
    """One pass's tree micro-batches, in order: rows, row tokens ``T``, tree tokens ``N``, branch copies, the tokens
    the model forwards (``N`` plus verl's tail padding), and the (query, key) pairs the tree's attention computes
    beside those of the per-row causal attention over the same rows. Invariant: after :meth:`settle` every entry is
    a host int and ``checks`` is empty; before it, :data:`_COUNTED` entries and ``checks`` hold 0-d device counts."""

    rows: list = field(default_factory=list)
    row_tokens: list = field(default_factory=list)
    tree_tokens: list = field(default_factory=list)
    branch_copies: list = field(default_factory=list)
    forwarded_tokens: list = field(default_factory=list)
    attention_pairs: list = field(default_factory=list)
    row_attention_pairs: list = field(default_factory=list)
    checks: list = field(default_factory=list)  # [{name: 0-d device count}] per unsettled micro-batch
    row_micro_batches: int = 0  # the pass's micro-batches the plan's cost model sent to rows (tree size 0)
    fallback_micro_batches: int = 0  # tree micro-batches that took the blocked kernel (flex past its recompile limit)

    def add(self, tree: DeviceTree, forwarded: int, checks: dict) -> None:
        self.rows.append(tree.num_rows)
        self.row_tokens.append(tree.num_row_tokens)
        self.tree_tokens.append(tree.num_tree_tokens)
        self.forwarded_tokens.append(forwarded)
        for name in _COUNTED:
            getattr(self, name).append(tree.stats[name])
        self.checks.append(checks)

    def settle(self) -> None:
        """Read every device count of the pass in one transfer (the pass's one device-to-host read); raise
        :class:`TrajInputError` naming the field when a tree micro-batch did not reproduce its rows."""
        pending = [i for i, v in enumerate(self.branch_copies) if isinstance(v, torch.Tensor)]
        if not pending:
            return
        names = sorted({name for c in self.checks for name in c})
        zero = torch.zeros((), dtype=torch.long, device=self.branch_copies[pending[0]].device)
        rows = [[getattr(self, n)[i] for n in _COUNTED] + [c.get(name, zero) for name in names]
                for i, c in zip(pending, self.checks)]
        values = torch.stack([torch.stack(r).long() for r in rows]).tolist()
        for row, i in zip(values, pending):
            for n, v in zip(_COUNTED, row):
                getattr(self, n)[i] = v
        self.checks = []
        for k, name in enumerate(names):
            count = sum(row[len(_COUNTED) + k] for row in values)
            if count:
                where, fix = _CHECK_FIX[name]
                raise TrajInputError(f"prefix-tree forward: {count} row token(s) of this pass's tree micro-batches "
                                     f"fail the {name} check. Fix: {fix}.", field=where)


@dataclass
class TreeTotals:
    """A worker's inference passes on trees since its last update: micro-batches and tree tokens (constant size: a
    reference worker, which never updates, and a rank that returns no output keep two numbers, not a log)."""

    micro_batches: int = 0
    tree_tokens: int = 0

    def add(self, log: TreeForwardLog) -> None:
        """Count a settled pass."""
        self.micro_batches += len(log.tree_tokens)
        self.tree_tokens += sum(log.tree_tokens)

    def take(self) -> "TreeTotals":
        """The totals so far, and zero them."""
        out = TreeTotals(self.micro_batches, self.tree_tokens)
        self.micro_batches = self.tree_tokens = 0
        return out


def require_tree_facts(keys: Any) -> None:
    """Raise :class:`TrajInputError` naming the first tree fact a marked pass's batch lacks."""
    missing = [k for k in (TREE_SEGMENT, TREE_SIZE) if k not in set(keys)]
    if missing:
        raise TrajInputError(
            f"a batch marked for the prefix-tree forward lacks the plan's {missing[0]!r} (received: {sorted(keys)}): "
            "the workers build each micro-batch's tree from the facts the trainer ships with the plan, never from "
            "token ids copied back to the host. Fix: plan the batch with verl_traj's trainer and traj.prefix_tree=true "
            "(it ships them next to mini_batch_id); a subclass that rebuilds the batch must keep them.",
            field=missing[0])


def check_marked(keys: Any) -> None:
    """A batch marked for the prefix-tree forward (its field names ``keys``) must carry the plan's ids and tree facts;
    raise naming the first one missing."""
    keys = set(keys)
    missing = [k for k in (MINI_BATCH_ID, MICRO_BATCH_ID) if k not in keys]
    if missing:
        raise TrajInputError(
            f"a batch marked {TREE_KEY!r} lacks the plan's {missing[0]!r}: its trees are the plan's micro-batches "
            f"(received: {sorted(keys)}). Fix: hand the workers the planned batch and the call's non-tensor data "
            "unmodified (verl_traj's trainer ships the plan's fields with every marked call; a subclass that "
            "rebuilds them must keep them).", field=missing[0])
    require_tree_facts(keys)


def micro_batch_tree_sizes(size: torch.Tensor, inverse: torch.Tensor, firsts: torch.Tensor) -> list[int]:
    """Each planned micro-batch's tree tokens from the rows' host ``size`` ``[b]`` (:data:`TREE_SIZE`): ``inverse``
    ``[b]`` micro-batch of each row, ``firsts`` ``[k]`` a row of each. Raises :class:`TrajInputError` (field
    ``TREE_SIZE``) when the rows of a micro-batch disagree (the batch was cut or reordered after planning)."""
    sizes = size[firsts]
    if not torch.equal(sizes[inverse], size):
        raise TrajInputError(
            f"the rows of a planned micro-batch carry different {TREE_SIZE!r} ({size.tolist()[:16]} for micro-batches "
            f"{inverse.tolist()[:16]}): the batch was re-cut or reordered after the trainer planned its trees. Fix: "
            "hand the workers the planned batch unmodified.", field=TREE_SIZE)
    return sizes.tolist()


def check_all_tree(log: TreeForwardLog, micro_batches_run: int, what: str) -> None:
    """Raise unless every one of the ``micro_batches_run`` micro-batches of a marked pass ran as the plan said: a tree,
    or rows where the plan's cost model chose rows (tree size 0)."""
    if len(log.tree_tokens) + log.row_micro_batches != micro_batches_run:
        raise RuntimeError(
            f"{what}: {micro_batches_run} micro-batches ran but {len(log.tree_tokens)} as prefix trees and "
            f"{log.row_micro_batches} as planned rows: the engine forwarded some without the tree hooks (an engine "
            "whose forward does not go through prepare_model_inputs?). traj.prefix_tree needs an engine with a tree "
            "seam; set traj.prefix_tree=false for this engine.")


def tree_metric_totals(log: TreeForwardLog, infer: Optional[TreeTotals]) -> list[float]:
    """``[10]`` this rank's sums, in :func:`tree_metrics_of`'s order, of a settled update ``log`` and the inference
    passes ``infer`` (``None``: none ran) since the worker's last update."""
    infer = infer or TreeTotals()
    return [sum(log.row_tokens), sum(log.tree_tokens), sum(log.branch_copies), len(log.tree_tokens),
            infer.micro_batches, infer.tree_tokens, sum(log.attention_pairs), sum(log.row_attention_pairs),
            log.row_micro_batches, log.fallback_micro_batches]


def tree_metrics_of(totals: list[float], ranks: int) -> dict[str, list]:
    """The update's tree metrics from :func:`tree_metric_totals` summed over ``ranks`` data-parallel ranks: row
    tokens, tree tokens (what the model forwarded, verl's tail padding aside), branch copies, tree micro-batches (per
    rank: their mean), row tokens per tree token, the (query, key) pairs of the trees' attention and of the per-row
    attention over the same rows, and the inference passes' micro-batches and tree tokens."""
    rows, tree, copies, micro, infer_micro, infer_tree, pairs, row_pairs, row_micro, fallback = totals
    return {"tree_planned_row_micro_batches": [row_micro / ranks], "tree_fallback_micro_batches": [fallback],"tree_row_tokens": [rows], "tree_tokens": [tree], "tree_branch_copies": [copies],
            "tree_attention_pairs": [pairs], "tree_row_attention_pairs": [row_pairs],
            "tree_micro_batches": [micro / ranks], "tree_row_tokens_per_tree_token": [rows / max(tree, 1.0)],
            "tree_infer_micro_batches": [infer_micro / ranks], "tree_infer_tokens": [infer_tree]}
