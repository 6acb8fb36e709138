"""The rows of a micro-batch as one prefix tree: every distinct prefix forwarded once (issue 29, item 1).

Rows of one micro-batch share long token prefixes (a GRPO group's prompt, the start of a trajectory whose merge chain
broke, a row that is a prefix of another). :func:`build_prefix_tree` puts them in a trie, serialised depth-first, so
one forward over ``N <= T`` tree tokens replaces the forward of ``T`` row tokens:

* ``position_ids`` = depth = each token's position in its own row;
* attention is restricted to each token's ancestors and itself: query ``q`` sees key ``k`` iff
  ``k <= q <= subtree_end[k]`` (the whole mask as one ``[N]`` interval; never an ``N x N`` tensor outside tests);
* next-token labels stay verl's rolled ones: a token's first child is the next serialised token. A token whose rows
  continue with ``m > 1`` distinct tokens is repeated: ``m - 1`` *branch copies* (same id, same position, placed as
  siblings of the original: same ancestors, not the original) each take one extra child and its subtree. A copy's
  K/V equal the original's (same token, position and ancestors), so no attention result changes, and every tree token
  has at most one child for its label: ``labels[k] = input_ids[k + 1]`` iff ``position_ids[k + 1] ==
  position_ids[k] + 1``, else ``-100`` (a leaf: every row through it ends there);
* ``row_index`` maps every row token back: row ``r``'s token ``j`` is tree token ``row_index[row_offsets[r] + j]``,
  the instance whose label is that row's token ``j + 1``; its ancestors are exactly the tree tokens of the row's
  tokens ``0..j`` (a row's last token has no next token: its tree token's label may be another row's). So tree
  outputs gathered with ``row_index`` (log-probs at the rolled labels, entropy, values) equal the per-row forward,
  and the backward through the gather sums each shared token's gradient over its rows.

Position ids reset at every branch: stock varlen attention (verl derives ``cu_seqlens`` from them) would read a tree
as separate sequences, silently wrong. A tree goes only to an attention that takes ``subtree_end``.

Layout: children in ascending token-id order, so the tree depends on the set of rows only (not their order). With the
distinct non-empty rows sorted lexicographically, row ``i`` adds one contiguous segment ``row_i[start_i:]``:
``start_i = 0`` (a new first token: a new root), ``lcp_i`` (the previous row is a prefix of it: it continues that
row's leaf) or ``lcp_i - 1`` (a branch: a copy of the branch token, then its own tokens), where ``lcp_i`` is its
longest common prefix with the previous row. The layout is :mod:`~verl_traj.core.trees.trie_layout`'s (array work over the
rows, shared with the driver's tree facts); the subtree ends here are for host trees (tests, benchmarks).

Pure module (torch and numpy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from verl_traj.core.errors import TrajInputError
from verl_traj.core.trees.token_rows import TokenRows, token_rows
from verl_traj.core.trees.trie_layout import row_index, segment_ids, trie_layout

__all__ = ["IGNORE_INDEX", "PrefixTree", "build_prefix_tree", "tree_token_count", "attention_pairs",
           "row_attention_pairs", "tree_attention_mask", "gather_flat", "gather_rows", "gather_padded"]

IGNORE_INDEX = -100  # label of a leaf (no next token), as verl's and torch's cross-entropy ignore it


@dataclass(frozen=True, eq=False)
class PrefixTree:
    """A micro-batch's rows as one depth-first serialised prefix tree (all tensors int64, CPU).

    ``N`` tree tokens, ``T`` row tokens (sum of row lengths), ``R`` rows:

    * ``input_ids``, ``position_ids`` (depth = position in its rows), ``labels`` (next token on its unique path,
      ``-100`` at a leaf: ``input_ids`` rolled by one wherever the next token is its child), all ``[N]``;
    * ``subtree_end`` ``[N]``: last tree index of the subtree rooted at ``k`` (inclusive); ``q`` attends ``k`` iff
      ``k <= q <= subtree_end[k]``;
    * ``row_index`` ``[T]``, ``row_offsets`` ``[R + 1]``: row ``r``'s tokens are tree tokens
      ``row_index[row_offsets[r]:row_offsets[r + 1]]`` (empty for an empty row); every tree token is used by a row;
    * ``num_branch_copies``: tree tokens that repeat a branch token; ``N - num_branch_copies`` is the number of
      distinct non-empty prefixes of the rows.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    subtree_end: torch.Tensor
    row_index: torch.Tensor
    row_offsets: torch.Tensor
    num_branch_copies: int

    @property
    def num_tree_tokens(self) -> int:  # N
        return int(self.input_ids.numel())

    @property
    def num_row_tokens(self) -> int:  # T = sum of row lengths (what a per-row forward costs)
        return int(self.row_offsets[-1])

    @property
    def num_rows(self) -> int:  # R, empty rows included
        return int(self.row_offsets.numel()) - 1

    @property
    def row_lengths(self) -> torch.Tensor:  # [R]
        return self.row_offsets[1:] - self.row_offsets[:-1]


def _subtree_end(starts: np.ndarray, lengths: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """``[N]`` subtree ends: in a depth-first order the subtree of ``k`` runs up to the next token of depth
    ``<= depth[k]``; for row ``i``'s token at depth ``p`` that is the first later segment with ``start <= p``.

    A monotonic stack of later segments (starts strictly increasing to the top) answers every depth of a segment with
    one ``searchsorted``; each segment is pushed and popped once: ``O(S)`` Python steps plus ``O(N)`` numpy."""
    n = int(offsets[-1])
    out = np.empty(n, dtype=np.int64)
    stack_start: list[int] = []
    stack_offset: list[int] = []
    for i in range(len(starts) - 1, -1, -1):
        start = int(starts[i])
        t = len(stack_start) - 1
        while t >= 0 and stack_start[t] > start:
            t -= 1
        cand_start = stack_start[t:] if t >= 0 else [-1] + stack_start  # -1: no later segment, runs to the end
        cand_offset = stack_offset[t:] if t >= 0 else [n] + stack_offset
        depth = np.arange(start, int(lengths[i]))
        pick = np.searchsorted(np.asarray(cand_start), depth, side="right") - 1
        out[offsets[i]:offsets[i + 1]] = np.asarray(cand_offset, dtype=np.int64)[pick] - 1
        while stack_start and stack_start[-1] >= start:
            stack_start.pop()
            stack_offset.pop()
        stack_start.append(start)
        stack_offset.append(int(offsets[i]))
    return out


def build_prefix_tree(rows: Sequence[torch.Tensor] | TokenRows) -> PrefixTree:
    """The prefix tree of ``rows`` (see :class:`PrefixTree` for the fields and invariants).

    Args:
        rows: ``R`` 1-D integer tensors (numpy arrays and int lists are accepted too), each row's attended token ids
            (prompt + response, no padding), ids ``>= 0``; an empty row (a padding row) maps to nothing. Or
            :class:`~verl_traj.core.trees.token_rows.TokenRows`.
    Returns the tree (CPU int64 tensors), independent of the order of ``rows`` (up to ``row_index``'s order).
    Raises :class:`TrajInputError` when ``rows`` is not a list, or ``rows[i]`` is not 1-D / integer / ids ``>= 0``.
    Cost: one sort of the rows, array work over their tokens (:mod:`~verl_traj.core.trees.trie_layout`).
    """
    rows = token_rows(rows)
    layout = trie_layout(rows, np.zeros(rows.num_rows, dtype=np.int64))
    n = int(layout.part_size.sum())
    sizes = layout.sizes
    input_ids = segment_ids(rows, layout)
    position_ids = np.arange(n, dtype=np.int64) - np.repeat(layout.offsets - layout.starts, sizes)
    labels = np.full(n, IGNORE_INDEX, dtype=np.int64)
    child = position_ids[1:] == position_ids[:-1] + 1  # the next serialised token is this token's (only) label child
    labels[:-1][child] = input_ids[1:][child]
    subtree_end = _subtree_end(layout.starts, layout.lengths, np.append(layout.offsets, n))
    t = [torch.from_numpy(a) for a in (input_ids, position_ids, labels, subtree_end,
                                       row_index(rows, layout).astype(np.int64), rows.offsets.copy())]
    return PrefixTree(*t, num_branch_copies=int(layout.copies.sum()))


def tree_token_count(rows: Sequence[Any] | TokenRows) -> tuple[int, int]:
    """``(tree tokens N, branch copies)`` of ``rows`` without building the tree (for benchmarks): one sort of the rows
    and their common prefixes. Rows as in :func:`build_prefix_tree` (tensors, arrays, lists)."""
    rows = token_rows(rows)
    layout = trie_layout(rows, np.zeros(rows.num_rows, dtype=np.int64))
    return int(layout.part_size.sum()), int(layout.copies.sum())


def attention_pairs(tree: PrefixTree) -> int:
    """(query, key) pairs the tree's attention computes: ``sum_k (position_ids[k] + 1)``."""
    return int((tree.position_ids + 1).sum())


def row_attention_pairs(tree: PrefixTree) -> int:
    """(query, key) pairs of the per-row causal attention over the same rows: ``sum_r L_r (L_r + 1) / 2``."""
    lengths = tree.row_lengths
    return int((lengths * (lengths + 1) // 2).sum())


def tree_attention_mask(tree: PrefixTree, *, max_tokens: int = 8192) -> torch.Tensor:
    """``[N, N]`` bool, ``mask[q, k]`` = query ``q`` attends key ``k`` (``k <= q <= subtree_end[k]``).

    FOR TESTS ONLY (dense reference attention): ``O(N^2)`` memory; trees over ``max_tokens`` tokens are refused.
    Kernels take ``subtree_end`` itself."""
    n = tree.num_tree_tokens
    if n > max_tokens:
        raise TrajInputError.invalid("tree", f"PrefixTree(N={n})", f"has more than max_tokens={max_tokens} tokens for "
                                     "a dense mask", "use subtree_end (the interval form) or raise max_tokens in tests")
    idx = torch.arange(n)
    return (idx[None, :] <= idx[:, None]) & (idx[:, None] <= tree.subtree_end[None, :])


def _checked_values(tree: PrefixTree, tree_values: Any) -> torch.Tensor:
    """``tree_values`` if it is a ``[N, ...]`` tensor, else a :class:`TrajInputError` (field ``tree_values``)."""
    n = tree.num_tree_tokens
    if not isinstance(tree_values, torch.Tensor) or tree_values.dim() < 1 or tree_values.shape[0] != n:
        shape = tuple(tree_values.shape) if isinstance(tree_values, torch.Tensor) else type(tree_values).__name__
        raise TrajInputError.invalid("tree_values", tree_values, f"is {shape}, not a tensor of [N={n}, ...]",
                                     "pass the per-token output of the forward over tree.input_ids")
    return tree_values


def gather_flat(tree: PrefixTree, tree_values: torch.Tensor) -> torch.Tensor:
    """``[N, ...]`` per tree token -> ``[T, ...]`` per row token (rows one after the other; differentiable: the
    gradient of a shared token sums over its rows). At row token ``j``, values computed from the prediction of row
    token ``j + 1`` (log-probs at ``tree.labels``) are that row's."""
    values = _checked_values(tree, tree_values)
    return values[tree.row_index.to(values.device)]


def gather_rows(tree: PrefixTree, tree_values: torch.Tensor) -> list[torch.Tensor]:
    """``[N, ...]`` -> one ``[L_r, ...]`` tensor per row (``[0, ...]`` for an empty row)."""
    return list(torch.split(gather_flat(tree, tree_values), tree.row_lengths.tolist()))


def gather_padded(tree: PrefixTree, tree_values: torch.Tensor, *, length: int | None = None,
                  pad_value: float = 0) -> torch.Tensor:
    """``[N, ...]`` -> ``[R, length, ...]``, row ``r``'s values left-aligned, ``pad_value`` after its ``L_r`` tokens;
    ``length`` defaults to the longest row (a shorter one is refused)."""
    flat = gather_flat(tree, tree_values)
    lengths = tree.row_lengths
    longest = int(lengths.max()) if lengths.numel() else 0
    length = longest if length is None else length
    if not isinstance(length, int) or isinstance(length, bool) or length < longest:
        raise TrajInputError.invalid("length", length, f"is not an int >= the longest row ({longest} tokens)",
                                     "pass None or at least the longest row's length")
    out = flat.new_full((tree.num_rows, length, *flat.shape[1:]), pad_value)
    row = torch.repeat_interleave(torch.arange(tree.num_rows), lengths)
    col = torch.arange(tree.num_row_tokens) - torch.repeat_interleave(tree.row_offsets[:-1], lengths)
    out[row.to(out.device), col.to(out.device)] = flat
    return out
