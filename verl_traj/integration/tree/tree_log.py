"""What the prefix-tree passes record (issue 40, item 4), bounded: one pass's per-micro-batch log
(:class:`TreeForwardLog`, dropped with the pass) and a worker's running totals of its inference passes
(:class:`TreeTotals`, two numbers whatever the length of the run; the next update reports and resets them).

The counts a tree micro-batch computes on the device (branch copies, attention pairs, the exactness checks) stay
there until the pass ends; :meth:`TreeForwardLog.settle` reads them all in one transfer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verl_traj.core.errors import TrajInputError
from verl_traj.core.tree_facts import DeviceTree
from verl_traj.integration.tree.tree_plan_facts import TREE_INDEX

__all__ = ["TreeForwardLog", "TreeTotals"]

_COUNTED = ("branch_copies", "attention_pairs", "row_attention_pairs")  # device counts, host ints once settled
_CHECK_FIX = {"tree_index": (TREE_INDEX, "the plan's tree facts do not reproduce these rows (the batch was changed or "
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
    checks: list = field(default_factory=list)  # [(first unsettled micro-batch, {name: 0-d device count})]

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
