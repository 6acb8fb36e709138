"""Every micro-batch's prefix tree at once, as array work over the whole batch (issue 40, item 2).

Rows carry a part key; the rows of one part form one tree (a planned micro-batch, a planning unit). Each tree is laid
out as :mod:`~verl_traj.core.trees.prefix_tree` describes: the part's distinct non-empty rows in lexicographic order, row
``i`` adding the segment ``row_i[start_i:]``, ``start_i`` = 0 (a new root), ``lcp_i`` (the previous row is a prefix
of it) or ``lcp_i - 1`` (a branch copy), ``lcp_i`` its common prefix with the previous row. Row ``i``'s token ``j``
is tree token ``offset_k + j - start_k`` of the row ``k = max{k <= i : start_k <= j}`` (the last row at or before it
whose segment covers depth ``j``).

Steps, each one pass over the batch, no Python loop over rows beyond building one sort key each (and one ``sorted``
call a part):

1. the rows by part, then one ``sorted`` a part over bytes keys (C ``memcmp`` up to the first difference);
2. each sorted row's common prefix with its predecessor, compared in blocks that double until every pair differs
   or ends (``O(sum of common prefixes)`` element work);
3. starts, segment offsets and each part's tree size by cumulative sums (parts never interleave: a part's first row
   starts a root);
4. the row paths: ``k`` above, as ``j`` falls from ``start_i`` to 0, runs down the chain of previous strictly smaller
   starts, which a sparse table of range minima gives for every row at once; each row's path is its chain's
   segments, one ``repeat`` over all of them (a chain link adds at least one token: links <= tokens).

Pure module (numpy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from verl_traj.core.errors import TrajInputError
from verl_traj.core.trees.token_rows import TokenRows

__all__ = ["TrieLayout", "trie_layout", "row_index", "segment_ids"]

_BLOCK_ELEMENTS = 1 << 22  # ids compared at once by the common-prefix search (bounds its memory)
_MAX_WIDTH = 4096  # columns a pair compares at once


@dataclass(frozen=True)
class TrieLayout:
    """``R`` rows in ``G`` parts as ``G`` serialised prefix trees; ``D`` distinct non-empty rows, in (part,
    lexicographic) order, each with its segment:

    * ``distinct`` ``[D]`` an input row holding it; ``part`` ``[D]`` its dense part (0..G-1, ascending);
    * ``starts`` / ``lengths`` ``[D]`` its first own position and its length; ``offsets`` ``[D]`` the tree index (in
      its part's tree) of its first own token; ``copies`` ``[D]`` bool, its segment starts with a branch copy;
    * ``of_row`` ``[R]`` distinct row of each input row (-1 for an empty row); ``part_of_row`` ``[R]`` dense part;
    * ``part_size`` ``[G]`` tree tokens of each part's tree (0 for a part of empty rows only).
    """

    distinct: np.ndarray
    part: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    offsets: np.ndarray
    copies: np.ndarray
    of_row: np.ndarray
    part_of_row: np.ndarray
    part_size: np.ndarray

    @property
    def sizes(self) -> np.ndarray:  # [D] tree tokens each distinct row adds
        return self.lengths - self.starts


def _lex_order(rows: TokenRows, part: np.ndarray, nonempty: np.ndarray) -> np.ndarray:
    """The ``nonempty`` rows sorted by (part, ids): by part with numpy, then each part's rows by their ids as
    big-endian bytes (non-negative integers sort like their values; 4 bytes an id where every id fits, else 8), one
    ``sorted`` a part (C ``memcmp`` up to the first difference)."""
    small = int(rows.ids.max(initial=0)) < 2**31
    data = memoryview(rows.ids.astype(">i4" if small else ">i8")).cast("B")
    off = (rows.offsets * (4 if small else 8)).tolist()
    keys = [data[off[r]:off[r + 1]].tobytes() for r in range(rows.num_rows)]
    by_part = nonempty[np.argsort(part[nonempty], kind="stable")]
    cuts = (np.flatnonzero(np.diff(part[by_part])) + 1).tolist()
    members, out = by_part.tolist(), []
    for lo, hi in zip([0] + cuts, cuts + [len(members)]):
        out += sorted(members[lo:hi], key=keys.__getitem__)
    return np.asarray(out, dtype=np.int64)


def _compare(ids: np.ndarray, a: np.ndarray, b: np.ndarray, width: int) -> np.ndarray:
    """``[P, width]`` ``ids[a_p + c] != ids[b_p + c]``: whole windows copied where they lie inside ``ids``, element
    gathers clamped to its end elsewhere (columns past the end are past both rows: the caller ignores them)."""
    n = ids.size
    inside = np.maximum(a, b) + width <= n
    out = np.empty((a.size, width), dtype=bool)
    if inside.any():
        window = sliding_window_view(ids, width)
        out[inside] = window[a[inside]] != window[b[inside]]
    if not inside.all():
        cols = np.arange(width, dtype=np.int64)
        edge = ~inside
        out[edge] = ids[np.minimum(a[edge, None] + cols, n - 1)] != ids[np.minimum(b[edge, None] + cols, n - 1)]
    return out


def _common_prefix(ids: np.ndarray, a: np.ndarray, b: np.ndarray, m: np.ndarray) -> np.ndarray:
    """``[P]`` common prefix lengths of ``ids[a_p : a_p + m_p]`` and ``ids[b_p : b_p + m_p]`` (within ``ids``):
    windows of columns that double while pairs still agree (at most ``_BLOCK_ELEMENTS`` ids a block, ``_MAX_WIDTH``
    columns); columns past ``m_p`` may compare other rows' ids, so a difference there counts as ``m_p``."""
    out = m.astype(np.int64, copy=True)
    live = np.flatnonzero(m > 0)
    pos, width = 0, 32
    while live.size:
        differ = _compare(ids, a[live] + pos, b[live] + pos, width)
        first = differ.argmax(1)
        hit = differ[np.arange(live.size), first]
        out[live] = np.minimum(np.where(hit, pos + first, pos + width), m[live])
        pos += width
        live = live[~hit & (m[live] > pos)]
        width = max(32, min(2 * width, _MAX_WIDTH, _BLOCK_ELEMENTS // max(live.size, 1)))
    return out


def _dense(part: Any, num_rows: int) -> np.ndarray:
    part = np.asarray(part)
    if part.shape != (num_rows,) or (part.size and part.dtype.kind not in "iu"):
        raise TrajInputError.invalid("part", part, f"is not [R={num_rows}] integer tree keys",
                                     "pass one integer key per row (the rows of one tree share it)")
    return np.unique(part, return_inverse=True)[1].reshape(-1).astype(np.int64)


def trie_layout(rows: TokenRows, part: Any) -> TrieLayout:
    """The trees of ``rows`` grouped by ``part`` (``[R]`` integer keys; rows with one key form one tree).

    Raises :class:`TrajInputError` (field ``part``) for keys that are not ``[R]`` integers."""
    of_part = _dense(part, rows.num_rows)
    lengths = rows.lengths
    order = _lex_order(rows, of_part, np.flatnonzero(lengths > 0))
    p, size = of_part[order], lengths[order]
    first = np.ones(order.size, dtype=bool)
    first[1:] = p[1:] != p[:-1]
    lcp = np.zeros(order.size, dtype=np.int64)
    later = np.flatnonzero(~first)
    lcp[later] = _common_prefix(rows.ids, rows.offsets[order[later - 1]], rows.offsets[order[later]],
                                np.minimum(size[later - 1], size[later]))
    prev = np.concatenate([[0], size[:-1]])
    dup = ~first & (lcp == size) & (size == prev)
    branch = ~first & ~dup & (lcp > 0) & (lcp < prev)
    starts = np.where(branch, lcp - 1, np.where(first | (lcp == 0), 0, lcp))
    keep = ~dup
    of_row = np.full(rows.num_rows, -1, dtype=np.int64)
    of_row[order] = np.cumsum(keep) - 1
    d_part, d_start, d_len = p[keep], starts[keep], size[keep]
    groups = int(of_part.max(initial=-1)) + 1
    part_size = np.bincount(d_part, weights=d_len - d_start, minlength=groups).astype(np.int64)
    serial = np.cumsum(d_len - d_start) - (d_len - d_start)  # exclusive: every tree one after another
    base = np.cumsum(part_size) - part_size
    return TrieLayout(order[keep], d_part, d_start, d_len, serial - base[d_part], branch[keep], of_row, of_part,
                      part_size)


def _prev_smaller(values: np.ndarray) -> np.ndarray:
    """``[D]`` the largest ``k < i`` with ``values[k] < values[i]`` (-1 where none): a sparse table of range minima
    (``table[l][k] = min(values[k : k + 2^l])``), then per row a descent over the powers of two."""
    n = values.size
    table = [values]
    while (1 << len(table)) <= n:
        half = 1 << (len(table) - 1)
        table.append(np.minimum(table[-1][:-half], table[-1][half:]))
    end = np.arange(n, dtype=np.int64)  # everything in [end, i) is >= values[i]
    for level in range(len(table) - 1, -1, -1):
        lo = end - (1 << level)
        ok = np.flatnonzero(lo >= 0)
        ok = ok[table[level][lo[ok]] >= values[ok]]
        end[ok] = lo[ok]
    return end - 1


def _chains(up: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(chain [sum depth], depth [D])``: each row's links ``i, up[i], up[up[i]], ...`` (to the first ``-1``), stored
    deepest first from ``cumsum(depth) - depth``; one round per link (as many as a path's branch points)."""
    rows, link, level_rows, level_links = np.arange(up.size), np.arange(up.size), [], []
    depth = np.zeros(up.size, dtype=np.int64)
    while rows.size:
        level_rows.append(rows)
        level_links.append(link)
        depth[rows] += 1
        link = up[link]
        rows, link = rows[link >= 0], link[link >= 0]
    first = np.cumsum(depth) - depth
    chain = np.empty(int(depth.sum()), dtype=np.int64)
    for level, (r, k) in enumerate(zip(level_rows, level_links)):
        chain[first[r] + depth[r] - 1 - level] = k
    return chain, depth


def row_index(rows: TokenRows, layout: TrieLayout) -> np.ndarray:
    """``[T]`` each input row token's tree token in its part's tree (the instance whose label is the row's next
    token), int32 where every tree is below 2^31 tokens, else int64: a row's path is its chain's segments (a
    duplicate row takes its distinct row's chain; an empty row has none), every piece of every row in one cumulative
    sum (one ``[T]`` array: the batch's largest)."""
    starts = layout.starts
    chain, depth = _chains(_prev_smaller(starts))  # never crosses a part: a part's first row has start 0
    first = np.cumsum(depth) - depth
    d = layout.of_row[layout.of_row >= 0]  # the non-empty input rows' distinct rows, in input order
    link = chain[np.repeat(first[d], depth[d]) + _within(depth[d])]  # each row's chain, root first
    lo = starts[link]
    hi = np.append(lo[1:], 0)
    ends = np.cumsum(depth[d]) - 1
    hi[ends] = layout.lengths[d]  # a row's own segment runs to its end
    size = hi - lo  # >= 1: starts strictly increase along a chain
    first_value = layout.offsets[link]  # a piece's tree tokens run first_value, first_value + 1, ... (one cumsum)
    out = np.ones(int(size.sum()), dtype=np.int32 if int(layout.part_size.max(initial=0)) < 2**31 else np.int64)
    if out.size:
        out[np.cumsum(size) - size] = first_value - np.concatenate([[0], first_value[:-1] + size[:-1] - 1])
        np.cumsum(out, out=out)
    return out


def _within(counts: np.ndarray) -> np.ndarray:
    """``[sum counts]`` 0, 1, ..., counts[i] - 1 for each ``i`` in turn."""
    return np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)


def segment_ids(rows: TokenRows, layout: TrieLayout) -> np.ndarray:
    """``[sum sizes]`` the tree tokens' ids, every part's tree one after another: each distinct row's segment."""
    sizes = layout.sizes
    total = int(sizes.sum())
    within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    return rows.ids[np.repeat(rows.offsets[layout.distinct] + layout.starts, sizes) + within]
