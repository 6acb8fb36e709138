"""Prefix trees planned once on the driver, built on the device in every pass (issue 40, item 3).

The driver holds every row's token ids on the host when it plans; the workers hold them on the device. So the trie is
built where the ids are on the host, once per step, and what the workers need travels with the plan:

* **Driver** (:func:`micro_batch_tree_facts`): the rows of each planned micro-batch (rows sharing a ``part`` key) form
  one tree, all laid out at once (:mod:`~verl_traj.core.trees.trie_layout`, the layout of
  :func:`~verl_traj.core.trees.prefix_tree.build_prefix_tree`). Every row gets three ints, its *segment*: the rank of
  its distinct row among its tree's rows in lexicographic order, and that row's segment start and first tree token;
  and the tree's size ``N`` (:class:`TreeFacts`). That is all a worker needs: row ``i``'s token ``j`` is tree token
  ``offset_k + j - start_k`` of ``k = max{k <= i : start_k <= j}`` (the trie layout's rule). Three ints a row instead of
  one per token: what the plan ships does not grow with the tokens (issue 55, item 4).
* **Worker** (:func:`segment_tree_index`, :func:`tree_from_facts`): each row token's tree index from the segments (a
  sparse table of range minima over the starts, one descent per token over the powers of two), then the tree's
  tokens, depths and subtree ends by scatters and one cumulative sum on the rows' own device. No host copy, no shape
  that depends on data (``N`` arrives as a host int with the plan), so no device-to-host sync; the same facts serve
  every pass and epoch.

Exactness is checked on the device, against the rows the worker actually holds: :attr:`DeviceTree.checks` counts
every row token whose facts disagree with the rows (0 on a tree that matches), read once per pass by the caller.
With ``q = index[t]`` for row ``r``'s token ``j`` the checks are: ``q`` in ``[0, N)``; every tree token used; the
tree token's id and depth are the row token's (``j``); indices strictly increase along a row; the next serialised
token is the row's next token (verl's rolled label); and ``q`` has exactly ``j + 1`` ancestors under the interval
rule ``k <= q <= subtree_end[k]``. The row's own earlier tokens are among them (indices increase, and
``subtree_end[k]`` is the largest last-token index of the rows through ``k``), so they are exactly its ancestors:
every row token sees exactly its row's earlier tokens, as in the per-row forward.

Pure module (torch and numpy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from verl_traj.core.errors import TrajInputError
from verl_traj.core.keys import TREE_SEGMENT
from verl_traj.core.trees.token_rows import TokenRows, token_rows
from verl_traj.core.trees.trie_layout import trie_layout

__all__ = ["DeviceTree", "TreeFacts", "micro_batch_tree_facts", "plan_sources", "planned_tree_facts",
           "segment_tree_index", "tree_from_facts"]


def plan_sources(rows: Any, order: Any, pad_rows: Any) -> tuple[TokenRows, np.ndarray]:
    """``(source rows, source [B])``: the planner's ``rows`` followed by the padding rows the plan wrote (``pad_rows``,
    as many as ``order`` has padding slots), and for each planned row (dispatch order) its source row in them: ``o``
    for ``o = order[i] >= 0``, the padding rows in turn for the slots ``o < 0``. The trees are built from the rows
    the planner costed, in their own order (no copy of their ids in dispatch order); only the padding rows, written
    by the plan, are read again. ``rows`` / ``pad_rows``: lists of rows or :class:`~verl_traj.core.trees.token_rows.TokenRows`."""
    rows, pad_rows = token_rows(rows), token_rows(pad_rows)
    source = np.asarray(order, dtype=np.int64).copy()
    slots = np.flatnonzero(source < 0)
    if slots.size != pad_rows.num_rows:
        raise TrajInputError(f"the plan has {slots.size} padding rows but {pad_rows.num_rows} were read",
                             field="pad_rows")
    source[slots] = rows.num_rows + np.arange(slots.size)
    return TokenRows.concat(rows, pad_rows), source


@dataclass(frozen=True)
class TreeFacts:
    """What the workers need to build each micro-batch's tree, per row (``R`` rows): ``segment`` ``[R, 3]`` int64
    (module docstring: the row's rank in its tree's lexicographic order, its distinct row's segment start and first
    tree token; ``(0, 0, 0)`` for an empty row); ``offsets`` ``[R + 1]`` int64, the rows' token offsets; ``size``
    ``[R]`` int64, the tree tokens ``N`` of the row's micro-batch."""

    segment: np.ndarray
    offsets: np.ndarray
    size: np.ndarray

    def index_of(self, members: Any) -> np.ndarray:
        """``[T_m]`` the tree index of every token of the rows ``members`` (one tree's rows, in any order), as a
        worker computes it (:func:`segment_tree_index`; tests and benchmarks)."""
        members = np.asarray(members, dtype=np.int64)
        lengths = np.diff(self.offsets)[members]
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        return segment_tree_index(offsets, torch.from_numpy(self.segment[members]), int(offsets[-1])).numpy()


def micro_batch_tree_facts(rows: Any, part: Any) -> TreeFacts:
    """The tree facts of ``rows`` (each row's attended token ids, as :func:`build_prefix_tree` takes them, or
    :class:`~verl_traj.core.trees.token_rows.TokenRows`), the rows with one ``part`` key (``[R]`` ints, e.g. rank, mini-batch
    and micro-batch combined) forming one tree.

    Invariant: :func:`segment_tree_index` of a part's rows' segments is :func:`build_prefix_tree` of those rows (in
    their order)'s ``row_index``. Raises :class:`TrajInputError` naming ``rows[i]`` or ``part``. Cost: every part's
    tree at once (:mod:`~verl_traj.core.trees.trie_layout`: one sort of the rows, array work over their tokens once);
    the output is per row."""
    rows = token_rows(rows)
    layout = trie_layout(rows, part)
    segment = np.zeros((rows.num_rows, 3), dtype=np.int64)  # an empty row: (0, 0, 0), its tree's first row's values
    d = layout.of_row
    rows_with = np.flatnonzero(d >= 0)
    first = np.searchsorted(layout.part, layout.part, side="left")  # [D] each distinct row's part's first
    segment[rows_with] = np.stack([(np.arange(d.max(initial=-1) + 1) - first)[d[rows_with]],
                                   layout.starts[d[rows_with]], layout.offsets[d[rows_with]]], axis=1)
    return TreeFacts(segment, rows.offsets, layout.part_size[layout.part_of_row])


def planned_tree_facts(rows: TokenRows, source: np.ndarray, part: Any) -> TreeFacts:
    """:func:`micro_batch_tree_facts` of planned rows given by their sources (:func:`plan_sources`): planned row ``i``
    is ``rows[source[i]]`` with part key ``part[i]``. The facts stay in the sources' order (``size`` and the rows of
    ``index`` / ``offsets`` are the source rows'); a source row no planned row takes forms a tree of its own."""
    keys = np.arange(rows.num_rows, dtype=np.int64) + int(np.max(part, initial=0)) + 1  # unplanned: one tree each
    keys[source] = part
    return micro_batch_tree_facts(rows, keys)


@dataclass(frozen=True, eq=False)
class DeviceTree:
    """One micro-batch's tree on the rows' device (``N`` tree tokens, ``T`` row tokens, ``R`` rows): ``input_ids``,
    ``position_ids`` (depths), ``subtree_end`` ``[N]`` int64 (query ``q`` attends key ``k`` iff
    ``k <= q <= subtree_end[k]``); ``row_index`` ``[T]`` (row token -> tree token) and ``row_offsets`` ``[R + 1]``
    (the rows' packed layout); ``checks``: 0-d int64 counts, each 0 when the facts match the rows (``tree_index``:
    row tokens the tree does not reproduce, ``position_ids``: row tokens whose position id is not their index in the
    row); ``stats``: 0-d ``branch_copies``, ``attention_pairs`` (the tree's (query, key) pairs) and
    ``row_attention_pairs`` (the per-row causal attention's). Host ints: ``num_tree_tokens``, ``num_row_tokens``,
    ``num_rows`` (shapes, no sync)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    subtree_end: torch.Tensor
    row_index: torch.Tensor
    row_offsets: torch.Tensor
    checks: dict
    stats: dict

    @property
    def num_tree_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_row_tokens(self) -> int:
        return int(self.row_index.shape[0])

    @property
    def num_rows(self) -> int:
        return int(self.row_offsets.shape[0]) - 1


def _checks(ids, depth, row, lengths, raw, idx, tree_ids, tree_depth, subtree_end) -> torch.Tensor:
    """0-d int64: row tokens whose tree does not reproduce them (module docstring's list), summed."""
    n = tree_ids.shape[0]
    inner = depth > 0
    last = depth == lengths[row] - 1
    cover = torch.zeros(n + 1, dtype=torch.long, device=ids.device)
    cover.index_add_(0, subtree_end + 1, torch.full_like(subtree_end, -1))
    cover = (cover[:n] + 1).cumsum(0)  # [N] keys k with k <= q <= subtree_end[k]
    unused = torch.ones(n, dtype=torch.long, device=ids.device).index_fill_(0, idx, 0).sum()
    bad = (raw != idx).long() + (tree_ids[idx] != ids).long() + (tree_depth[idx] != depth).long()
    bad += (inner & (idx <= idx.roll(1))).long()
    bad += (~last & (tree_ids[(idx + 1).clamp(max=n - 1)] != ids.roll(-1))).long()
    return bad.sum() + (cover != tree_depth + 1).sum() + unused


def segment_tree_index(row_offsets: torch.Tensor, segment: torch.Tensor, num_row_tokens: int) -> torch.Tensor:
    """``[T]`` int64 each row token's tree index in its micro-batch's tree, from the rows' segments.

    Args:
        row_offsets: ``[R + 1]`` int64 the rows' packed layout (on the rows' device).
        segment: ``[R, 3]`` (:class:`TreeFacts`): rank, start, offset per row.
        num_row_tokens: ``T`` (a host int, the rows' packed length: no device read).
    Row ``r``'s token ``j`` (rank ``i``) gets ``offset_k + j - start_k`` with ``k = max{k <= i : start_k <= j}``:
    a sparse table of range minima over the starts by rank, then a descent over the powers of two for every token at
    once (``log2 R`` gathers over ``[T]``). Facts that do not describe a tree give some index in range or not; the
    caller's :func:`tree_from_facts` checks count every token it gets wrong (never a host sync here)."""
    device, rows = row_offsets.device, segment.shape[0]
    if segment.dim() != 2 or segment.shape[1] != 3 or row_offsets.shape[0] != rows + 1:
        raise TrajInputError(f"{TREE_SEGMENT} of shape {tuple(segment.shape)} for a micro-batch of "
                             f"{row_offsets.shape[0] - 1} rows (want [{row_offsets.shape[0] - 1}, 3]): the batch was "
                             "cut or reordered after the trainer planned its trees. Fix: hand the workers the planned "
                             "batch unmodified.", field=TREE_SEGMENT)
    seg = segment.to(device=device, dtype=torch.long)
    rank, start, offset = seg[:, 0].clamp(0, max(rows - 1, 0)), seg[:, 1], seg[:, 2]
    starts = torch.full((rows,), torch.iinfo(torch.long).max, dtype=torch.long, device=device).scatter_(0, rank, start)
    offsets = torch.zeros(rows, dtype=torch.long, device=device).scatter_(0, rank, offset)
    table = [starts]  # table[l][k] = min(starts[k : k + 2^l])
    while (1 << len(table)) <= rows:
        half = 1 << (len(table) - 1)
        table.append(torch.minimum(table[-1][:-half], table[-1][half:]))
    row = torch.repeat_interleave(torch.arange(rows, device=device), row_offsets.diff(), output_size=num_row_tokens)
    depth = torch.arange(num_row_tokens, device=device) - row_offsets[row]
    end = rank[row] + 1  # every rank in [end, i] starts after the token
    for level in range(len(table) - 1, -1, -1):
        lo = end - (1 << level)
        move = (lo >= 0) & (table[level][lo.clamp(min=0)] > depth)
        end = torch.where(move, lo, end)
    k = (end - 1).clamp(min=0)
    return offsets[k] + depth - starts[k]


def tree_from_facts(input_ids: torch.Tensor, position_ids: torch.Tensor, row_offsets: torch.Tensor,
                    tree_index: torch.Tensor, num_tree_tokens: int) -> DeviceTree:
    """The micro-batch's tree from its rows and the plan's facts, as tensor ops on the rows' device.

    Args:
        input_ids, position_ids: ``[T]`` the rows' packed token ids and position ids (remove-padding layout).
        row_offsets: ``[R + 1]`` int64 row starts in the packed layout (on the same device).
        tree_index: ``[T]`` each row token's tree index, packed like the rows (:func:`segment_tree_index`).
        num_tree_tokens: ``N`` (a host int: it sizes the tree).
    Returns a :class:`DeviceTree`; mismatches are counted in ``checks`` (never a host sync here: the caller reads
    them once per pass). Raises :class:`TrajInputError` (field ``num_tree_tokens``) for ``N < 1``, (field
    ``prefix_tree_index``) for an index whose length is not the rows' (host shapes: no sync)."""
    n = int(num_tree_tokens)
    if n < 1:
        raise TrajInputError.invalid("num_tree_tokens", n, "is below 1", "ship the plan's tree size per row")
    device, t = input_ids.device, input_ids.shape[0]
    rows = row_offsets.shape[0] - 1
    if tree_index.dim() != 1 or tree_index.shape[0] != t:
        raise TrajInputError(
            f"the tree index of shape {tuple(tree_index.shape)} for a micro-batch of {rows} rows and {t} tokens (want "
            f"[{t}], packed like the rows): the batch was cut, reordered or re-tokenised after the trainer "
            "planned its trees. Fix: hand the workers the planned batch unmodified.", field=TREE_SEGMENT)
    ids, lengths = input_ids.long(), row_offsets.diff()
    row = torch.repeat_interleave(torch.arange(lengths.shape[0], device=device), lengths, output_size=t)
    depth = torch.arange(t, device=device) - row_offsets[row]
    raw = tree_index.to(device).long()
    idx = raw.clamp(0, n - 1)
    # a tree token no row uses keeps id and depth 0 (valid model inputs whatever the facts; the checks count it)
    tree_ids = torch.zeros(n, dtype=torch.long, device=device).scatter_(0, idx, ids)
    tree_depth = torch.zeros(n, dtype=torch.long, device=device).scatter_(0, idx, depth)
    last_of_row = idx[(row_offsets[1:] - 1).clamp(min=0)][row]  # each row token's row's last tree token
    subtree_end = torch.arange(n, device=device).scatter_reduce(0, idx, last_of_row, "amax")
    checks = {"tree_index": _checks(ids, depth, row, lengths, raw, idx, tree_ids, tree_depth, subtree_end),
              "position_ids": (position_ids.long() != depth).sum()}
    stats = {"branch_copies": _branch_copies(tree_ids, tree_depth), "attention_pairs": (tree_depth + 1).sum(),
             "row_attention_pairs": (lengths * (lengths + 1) // 2).sum()}
    return DeviceTree(tree_ids, tree_depth, subtree_end, idx, row_offsets, checks, stats)


def _branch_copies(tree_ids: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """0-d: tree tokens that repeat a branch token (the builder's layout): a token not deeper than the one before it
    (a segment start) below the root, or a root with the id of the root before it."""
    d = depth
    positions = torch.arange(d.shape[0], device=d.device)
    last_root = torch.where(d == 0, positions, 0).cummax(0).values  # [N] the latest root at or before each token
    below = (d[1:] > 0) & (d[1:] <= d[:-1])
    root_again = (d[1:] == 0) & (tree_ids[1:] == tree_ids[last_root[:-1]])
    return (below | root_again).sum()
