"""A session's LLM calls as a tree (issue 56): the facts rows and credit read from a forked, sub-agent or condensed
session, each computed once, as array work over the calls.

A session's calls arrive in issue order, each naming its parent: the call whose prompt and response its prompt extends
(``-1``: a fresh context, a root: the session's first call, a sub-agent's first call, the call after a condensation).
A fork is a call with more than one child: best-of-N from a mid-state, sibling branches of tree search. Every fact
below is defined on this tree and reduces to today's on a chain (each call the previous call's only child):

* **rows**, a path decomposition: a call continues its parent's row when it is its parent's first child (in issue
  order), else it starts a row of its own whose masked prompt is its parent's context; so every call's response is a
  loss span of exactly one row (each loss token trains once) and a chain is one row;
* **leaves below** ``m_c``: the root-to-leaf paths through call ``c`` (1 on a chain): the ``expanded`` weighting
  trains call ``c`` ``m_c`` times, as one row per path would;
* **returns on the tree**: ``V(c) = r_c + gamma x mean over c's children of V(child)`` (a leaf: ``r_c``); on a chain
  the discounted return;
* **leaf spans**: the leaves numbered depth-first, so each call's leaves are contiguous: what the batch carries and the
  credit on a tree reads (:mod:`verl_traj.stepwise.tree_credit` computes every per-leaf rule from them).

Calls are numbered ``0..C-1`` in issue order, and a parent precedes its children (``parent[c] < c``). The functions
loop over depth levels (the tree's height), never over calls, but for :meth:`CallTree.leaf_spans`' one depth-first
walk of a session's calls. Pure module (numpy).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from verl_traj.stepwise.expand_inputs import StepExpansionError

__all__ = ["CallTree", "call_tree", "pack_leaf_span", "unpack_leaf_span"]


@dataclass(frozen=True)
class CallTree:
    """``C`` calls: ``parent`` ``[C]`` int64 (``-1`` a root, else an earlier call); ``depth`` ``[C]`` (roots 0);
    ``children`` ``[C]`` child counts; ``first_child`` ``[C]`` bool, the call is its parent's first child (roots:
    False)."""

    parent: np.ndarray
    depth: np.ndarray
    children: np.ndarray
    first_child: np.ndarray

    @property
    def num_calls(self) -> int:
        return int(self.parent.size)

    @property
    def is_leaf(self) -> np.ndarray:
        return self.children == 0

    def levels(self) -> list[np.ndarray]:
        """The calls of each depth, deepest first (the order every bottom-up pass takes)."""
        order = np.argsort(-self.depth, kind="stable")
        cuts = np.flatnonzero(np.diff(self.depth[order])) + 1
        return np.split(order, cuts)

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        """``(row [C], starts [C] bool)``: the path decomposition (module docstring); rows numbered by their first
        call's issue order. A call that starts a row takes its parent's context as masked prompt (``parent >= 0``) or
        none (a root)."""
        starts = ~self.first_child
        row = np.cumsum(starts) - 1
        for level in reversed(self.levels()):  # shallowest first: a continuing call takes its parent's row
            cont = level[~starts[level]]
            row[cont] = row[self.parent[cont]]
        return row, starts

    def leaves_below(self) -> np.ndarray:
        """``[C]`` int64 ``m_c``: leaves in ``c``'s subtree (a leaf counts itself)."""
        return self.sum_up(self.is_leaf.astype(np.int64))

    def sum_up(self, leaf_values: np.ndarray) -> np.ndarray:
        """``[C]`` each call's sum of ``leaf_values`` ``[C]`` over the leaves below it (values off the leaves are
        ignored)."""
        total = np.where(self.is_leaf, leaf_values, 0).astype(np.result_type(leaf_values, np.int64))
        for level in self.levels()[:-1]:  # every level but the roots' (the last: depth 0)
            below = level[self.parent[level] >= 0]
            np.add.at(total, self.parent[below], total[below])
        return total

    def mean_of_leaves(self, leaf_values: np.ndarray) -> np.ndarray:
        """``[C]`` float64 each call's mean of ``leaf_values`` over the leaves below it."""
        return self.sum_up(np.asarray(leaf_values, dtype=np.float64)) / self.leaves_below()

    def leaf_spans(self) -> tuple[np.ndarray, np.ndarray]:
        """``(lo [C], hi [C])`` int64: the leaves numbered in depth-first order (children in issue order), call ``c``'s
        leaves are exactly ``lo[c] .. hi[c] - 1`` (contiguous), so ``hi - lo`` is ``m_c`` and a mean over ``L(c)`` is a
        difference of prefix sums. Roots in issue order; a chain: every call ``(0, 1)``."""
        kids: list[list[int]] = [[] for _ in range(self.num_calls)]
        for c in np.flatnonzero(self.parent >= 0).tolist():
            kids[int(self.parent[c])].append(c)
        rank = np.full(self.num_calls, -1, dtype=np.int64)
        stack, n = np.flatnonzero(self.parent < 0)[::-1].tolist(), 0
        while stack:  # one pass over the session's calls (a session holds tens to hundreds)
            c = stack.pop()
            if not kids[c]:
                rank[c], n = n, n + 1
            stack.extend(reversed(kids[c]))
        lo, hi = np.where(self.is_leaf, rank, np.iinfo(np.int64).max), np.where(self.is_leaf, rank + 1, 0)
        for level in self.levels()[:-1]:
            below = level[self.parent[level] >= 0]
            np.minimum.at(lo, self.parent[below], lo[below])
            np.maximum.at(hi, self.parent[below], hi[below])
        return lo, hi

    def returns(self, rewards: np.ndarray, gamma: float) -> np.ndarray:
        """``[C]`` float64 ``V(c) = r_c + gamma x mean_{children} V(child)`` from per-call rewards ``[C]``."""
        value = np.asarray(rewards, dtype=np.float64).copy()
        acc = np.zeros(self.num_calls)
        for level in self.levels():
            value[level] += np.where(self.children[level] > 0, gamma * acc[level] / np.maximum(self.children[level], 1),
                                     0.0)
            below = level[self.parent[level] >= 0]
            np.add.at(acc, self.parent[below], value[below])
        return value


def call_tree(parent: "np.ndarray | list[int]") -> CallTree:
    """The tree of a session's ``parent`` links (``[C]``, issue order). Raises :class:`StepExpansionError` (field
    ``parent``) where a call names itself, a later call or a call that does not exist."""
    parent = np.asarray(parent, dtype=np.int64).reshape(-1)
    calls = np.arange(parent.size)
    bad = np.flatnonzero((parent < -1) | (parent >= calls))
    if bad.size:
        c = int(bad[0])
        raise StepExpansionError(
            f"call {c} names parent {int(parent[c])}: a call's parent must be an earlier call of its session (0..{c - 1})"
            " or -1 for a fresh context. Fix: record each call's parent as the index of the call whose prompt and "
            "response it extends, in issue order.", field="parent")
    depth, up = (parent >= 0).astype(np.int64), parent.copy()
    while (up >= 0).any():  # pointer jumping: log(height) rounds, each ancestor jump doubling
        live = up >= 0
        depth[live], up[live] = depth[live] + depth[up[live]], up[up[live]]
    children = np.bincount(parent[parent >= 0], minlength=parent.size).astype(np.int64)
    has = parent >= 0
    first_of = np.full(parent.size, parent.size, dtype=np.int64)
    np.minimum.at(first_of, parent[has], calls[has])
    first_child = np.zeros(parent.size, dtype=bool)
    first_child[has] = first_of[parent[has]] == calls[has]
    return CallTree(parent, depth, children, first_child)


_SPAN_BITS = 31  # a session's leaves below 2^31


def pack_leaf_span(lo: np.ndarray, hi: np.ndarray, own: np.ndarray) -> np.ndarray:
    """``[C]`` int64 keys, never 0, of each call's leaf span (:meth:`CallTree.leaf_spans`) and whether the call is a
    leaf carrying its own outcome (``own``): what the step rows carry on each call's first response token
    (:data:`~verl_traj.core.keys.TREE_CALLS`), 0 meaning "no call starts here"."""
    lo, hi = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
    return (lo << (_SPAN_BITS + 1)) | (hi << 1) | np.asarray(own, dtype=np.int64)


def unpack_leaf_span(key):
    """``(lo, hi, own)`` of :func:`pack_leaf_span`'s keys (numpy arrays or int64 tensors, any shape; 0 gives
    ``(0, 0, 0)``)."""
    mask = (1 << _SPAN_BITS) - 1
    return key >> (_SPAN_BITS + 1), (key >> 1) & mask, key & 1
