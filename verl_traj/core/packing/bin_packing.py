"""Fewest bins of a token cap for one block of rows (one rank's rows of a mini-batch): the micro-batch count.

Bin packing with the token sum as each bin's load. :func:`fewest_bins` returns the bins and the best lower
bound it knows:

* the bound starts at Martello and Toth's L2 (:func:`bin_lower_bound`): at least ``ceil(sum / cap)``, at least
  the number of rows longer than ``cap / 2`` (no two share a bin), and the bound of every threshold in between;
* from that bound upward, each count ``k`` first gets an exact search (:func:`pack_into`, bin completion: the
  longest row left opens the next bin, which is completed by every subset of the rows left that fills it to
  within the slack ``k * cap - sum`` still unspent, those within a fair share of it first), under a work
  budget. A search that finishes either returns a packing into ``k`` bins or proves that none exists, and the
  bound rises to ``k + 1``;
* a search that runs out of budget is retried in plain depth-first order, then followed, at the same ``k``, by
  longest-processing-time (LPT) repaired by a local search of moves and swaps (:func:`repaired_bins`: it finds the
  tight packings of many similar rows that a depth-first search cannot reach in budget) and the caller's
  partitioner (the verl adapter passes verl's own Karmarkar-Karp, so the count never exceeds verl's
  ``rearrange_micro_batches`` on the same rows) where ``rows x k <= PARTITIONER_LIMIT`` (verl's Karmarkar-Karp
  builds ``rows x k`` Python objects: 1.6 s for a block of 780 rows into 390 micro-batches, seven such blocks 11 s
  of a 10^5-row step; past the limit one micro-batch more than verl's cut is possible, a small share of that many);
  best-fit decreasing (BFD) ends the scan.

So the count equals the bound wherever the exact search finishes, and mostly where it does not: on the lengths
agent rows have (many rows, each well under the cap) it finishes in a few thousand steps. Pure module (numpy).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from verl_traj.core.packing.balancing import lpt

__all__ = ["EXACT_UNSETTLED_COUNTS", "EXACT_WORK_BUDGET", "REPAIR_STEPS", "SEARCH_LIMIT", "BinPacking", "Partitioner", "bin_lower_bound",
           "fewest_bins", "fits", "pack_into", "repaired_bins"]

EXACT_WORK_BUDGET = 20_000  # steps of one exact search (per count and order); a bin's set-up costs its row count
SEARCH_LIMIT = 10 * EXACT_WORK_BUDGET  # rows x bins of the largest block the exact search runs on
EXACT_UNSETTLED_COUNTS = 2  # counts the exact search may leave unsettled per block before only heuristics run
REPAIR_STEPS = 64  # local-search exchanges after LPT where the exact search did not settle a count
PARTITIONER_LIMIT = 64_000  # rows x bins of the largest block the caller's partitioner is asked for (about 0.3 s)
# (row lengths, number of parts) -> parts as lists of row positions (may return parts over the cap)
Partitioner = Callable[[list[int], int], Sequence[Sequence[int]]]


@dataclass(frozen=True)
class BinPacking:
    """Result of :func:`fewest_bins`: ``bins`` (lists of positions into ``sizes``, every position once, each
    bin's sizes sum to at most ``cap``) and ``lower_bound``: no packing has fewer bins (``<= len(bins)``,
    equal wherever the exact search settled every smaller count)."""

    bins: list[list[int]]
    lower_bound: int


class _OutOfBudget(Exception):
    pass


def bin_lower_bound(sizes: Sequence[int], cap: int) -> int:
    """Martello-Toth L2 lower bound on the bins of ``cap`` that ``sizes`` (``[n]`` ints in ``0..cap``) need.

    For each threshold ``t`` in ``{0} U {sizes <= cap/2}``: rows longer than ``cap - t`` take a bin alone, rows in
    ``(cap/2, cap - t]`` one bin each, and rows in ``[t, cap/2]`` fill those bins' room before opening new ones.
    ``t = 0`` includes ``ceil(sum / cap)`` and the count of rows over ``cap / 2``. O(n log n), vectorised."""
    s = np.sort(np.asarray(sizes, dtype=np.int64))
    if s.size == 0:
        return 0
    prefix = np.concatenate([[0], np.cumsum(s)])
    half = cap // 2  # rows <= half pair up with anything of at most cap - half; rows > cap / 2 never pair
    t = np.unique(np.concatenate([[0], s[s <= half]]))
    big = np.searchsorted(s, cap - t, side="right")  # first row > cap - t
    mid = np.searchsorted(s, half, side="right")  # first row > cap / 2
    low = np.searchsorted(s, t, side="left")  # first row >= t
    n_mid = big - mid
    room = n_mid * cap - (prefix[big] - prefix[mid])
    small = prefix[mid] - prefix[low]
    bound = (s.size - big) + n_mid + np.maximum(0, -(-(small - room) // cap))
    return int(max(-(-int(prefix[-1]) // cap), int(bound.max()), 1))


def _completions(sizes: list[int], items: list[int], slack: int, cap: int, fair: int,
                 left: list[int]) -> Iterator[tuple[list[int], int]]:
    """Every way to complete the bin that ``items[0]`` (the longest row left) opens: yields ``(subset of
    items[1:], slack left)`` for each subset whose bin wastes at most ``slack``. Subsets wasting at most ``fair``
    come first (a fair share of the slack: early bins do not spend what later ones need); within each group,
    depth-first over rows in descending order, taking a row before leaving it out. Rows of equal length
    are interchangeable: a subset takes a prefix of each run of them, so no subset comes twice.
    ``left[0]``: work left (a row of set-up or a search step costs one; raises when spent)."""
    first, rest = items[0], items[1:]
    lengths = [sizes[i] for i in rest]
    neg = [-x for x in lengths]  # ascending, for bisect
    suffix = list(accumulate(reversed(lengths)))[::-1] + [0]
    after_run = [bisect.bisect_right(neg, -x) for x in lengths]  # first row shorter than row p
    high = cap - sizes[first]
    left[0] -= len(rest) + 1
    for low, top in ((high - fair, high), (high - slack, high - fair - 1)):  # fill in [low, top]
        chosen: list[int] = []
        j = c = 0
        while low <= top:
            left[0] -= 1
            if left[0] < 0:
                raise _OutOfBudget
            if c <= top and j < len(lengths) and c + suffix[j] >= low:
                if c + lengths[j] <= high:  # take row j
                    chosen.append(j)
                    c += lengths[j]
                    j += 1
                else:  # skip to the first row that still fits
                    j = bisect.bisect_left(neg, c - high, j)
                continue
            if j >= len(lengths) and low <= c <= top:
                yield [rest[p] for p in chosen], slack - (high - c)
            if not chosen:
                break
            p = chosen.pop()  # leave row p and its equal-length followers out
            c -= lengths[p]
            j = after_run[p]


def pack_into(sizes: list[int], k: int, cap: int, budget: int = EXACT_WORK_BUDGET, *,
              fair_first: bool = True) -> tuple[Optional[list], bool]:
    """Exact search for a packing of ``sizes`` (sorted descending) into ``k`` bins of ``cap`` (bin completion).
    ``fair_first=False`` tries each bin's completions in plain depth-first order (longest rows first), which
    keeps rows of similar length together (less padding) but settles tight instances more slowly.

    Returns ``(bins, True)`` when found, ``(None, True)`` when proven impossible, ``(None, False)`` when the
    budget ran out first. Complete: some bin of any packing holds the longest row, and every completion of its
    bin that wastes no more than the slack left is tried. The rows left after a bin whose every completion
    failed are remembered (as lengths, with the bins left): another way to reach them is not searched again."""
    if not sizes:
        return [], True
    slack = k * cap - sum(sizes)
    if k < 1 or slack < 0 or sum(2 * x > cap for x in sizes) > k:
        return None, True
    left, failed = [budget], set()

    def frame(items: list[int], frame_slack: int, bins_left: int) -> tuple:
        key = (bins_left, *[sizes[i] for i in items])
        fair = frame_slack // bins_left if fair_first else frame_slack
        return _completions(sizes, items, frame_slack, cap, fair, left), items, key

    stack = [frame(list(range(len(sizes))), slack, k)]
    bins: list[list[int]] = []
    try:
        while stack:
            search, items, key = stack[-1]
            found = next(search, None)
            del bins[len(stack) - 1:]
            if found is None:
                failed.add(key)
                stack.pop()
                continue
            subset, rest_slack = found
            bins.append([items[0], *subset])
            taken = set(subset)
            rest = [i for i in items[1:] if i not in taken]
            if not rest:
                return bins, True
            if len(stack) < k and sum(2 * sizes[i] > cap for i in rest) <= k - len(stack):
                nxt = frame(rest, rest_slack, k - len(stack))
                if nxt[2] not in failed:
                    stack.append(nxt)
    except _OutOfBudget:
        return None, False
    return None, True


def _best_fit_decreasing(sizes: list[int], cap: int) -> list[list[int]]:
    """BFD on ``sizes`` sorted descending -> bins (positions). Free room is kept sorted as
    ``room * K + bin`` ints so ``bisect`` finds the tightest bin that fits in O(log bins)."""
    K = len(sizes) + 1
    free: list[int] = []
    bins: list[list[int]] = []
    for i, t in enumerate(sizes):
        k = bisect.bisect_left(free, t * K)
        if k < len(free):
            key = free.pop(k)
            b = key % K
            bisect.insort(free, key - t * K)
        else:
            b = len(bins)
            bins.append([])
            bisect.insort(free, (cap - t) * K + b)
        bins[b].append(i)
    return bins


def repaired_bins(sizes: list[int], k: int, cap: int, steps: int = REPAIR_STEPS,
                  start: Optional[Sequence[Sequence[int]]] = None) -> list[list[int]]:
    """``start`` (``k`` bins of positions; default LPT's ``k`` bins), then local search: each step moves a row out
    of the fullest bin, or swaps one of its rows with a shorter row of another bin (a move is a swap with an empty
    slot), taking the exchange that lowers the total overflow ``sum(max(0, load - cap))`` most, else, at equal
    overflow, the sum of squared loads most (more even bins leave room). Neither rises, so it stops: when all fit,
    nothing improves, or after ``steps``. Vectorised over the fullest bin's rows x every other row and slot.
    Returns the non-empty bins; they may still overflow (check with :func:`fits`)."""
    x = np.asarray(sizes, dtype=np.int64)
    if start is None:
        assign = lpt(x, k, order=np.arange(x.size))
    else:
        assign = np.empty(x.size, dtype=np.int64)
        for j, b in enumerate(start):
            assign[list(b)] = j
    loads = np.bincount(assign, weights=x, minlength=k).astype(np.int64)
    for _ in range(steps):
        h = int(np.argmax(loads))
        if loads[h] <= cap or k < 2:
            break
        mine, other = np.flatnonzero(assign == h), np.flatnonzero(assign != h)
        partner = np.concatenate([other, np.full(k, -1)])  # -1: an empty slot of bin t (a move)
        where = np.concatenate([assign[other], np.arange(k)])
        size = np.where(partner >= 0, x[partner], 0)
        keep = where != h
        partner, where, size = partner[keep], where[keep], size[keep]
        d = x[mine][:, None] - size[None, :]  # load that leaves bin h
        new_h, new_o = loads[h] - d, loads[where][None, :] + d
        over = (np.maximum(new_h - cap, 0) + np.maximum(new_o - cap, 0)
                - max(loads[h] - cap, 0) - np.maximum(loads[where] - cap, 0)[None, :])
        square = new_h * new_h + new_o * new_o - loads[h] ** 2 - (loads[where] ** 2)[None, :]
        best = np.lexsort((square.ravel(), over.ravel()))[0]
        a, b = divmod(int(best), size.size)
        if over.flat[best] > 0 or (over.flat[best] == 0 and square.flat[best] >= 0):
            break
        loads[h] -= int(d[a, b])
        loads[where[b]] += int(d[a, b])
        assign[mine[a]] = where[b]
        if partner[b] >= 0:
            assign[partner[b]] = h
    return [b.tolist() for b in (np.flatnonzero(assign == j) for j in range(k)) if b.size]


def fits(bins: Sequence[Sequence[int]], sizes: list[int], cap: int) -> bool:
    """Every bin's sizes sum to at most ``cap``."""
    return all(sum(sizes[i] for i in b) <= cap for b in bins)


def _exact(sizes: list[int], k: int, cap: int, budget: int) -> tuple[Optional[list[list[int]]], bool]:
    """:func:`pack_into` in the fair-share order, then, where that ran out of budget, in plain depth-first order:
    tight instances that one order misses, the other often finds."""
    bins, settled = pack_into(sizes, k, cap, budget)
    if settled:
        return bins, settled
    return pack_into(sizes, k, cap, budget, fair_first=False)


def fewest_bins(sizes: list[int], cap: int, partitioner: Optional[Partitioner] = None,
                budget: int = EXACT_WORK_BUDGET) -> BinPacking:
    """Fewest bins of ``cap`` for ``sizes`` (``[n]`` ints in ``0..cap``, sorted descending), see the module
    docstring. ``partitioner``: an extra candidate tried where the exact search ran out of budget. The exact and
    the local search run only where ``rows x k <= 10 x budget`` (a descent of the search sets up about
    ``rows x k / 2`` steps) and for the first ``EXACT_UNSETTLED_COUNTS`` counts they leave unsettled; else LPT and
    the partitioner (a huge or hard block costs a bounded time: one micro-batch more is a small share there)."""
    if not sizes:
        return BinPacking([], 0)
    bfd = _best_fit_decreasing(sizes, cap)
    lower = bin_lower_bound(sizes, cap)
    unsettled = 0
    for k in range(lower, len(bfd)):
        searching = unsettled < EXACT_UNSETTLED_COUNTS and len(sizes) * k <= SEARCH_LIMIT * budget // EXACT_WORK_BUDGET
        bins, settled = _exact(sizes, k, cap, budget) if searching else (None, False)
        if bins is not None:
            return BinPacking(bins, lower)
        if settled:  # no packing into k bins, so none into fewer
            lower = k + 1
            continue
        unsettled += 1
        bins = repaired_bins(sizes, k, cap, REPAIR_STEPS if searching else 0)  # 0 steps: LPT
        if fits(bins, sizes, cap):
            return BinPacking(bins, lower)
        if partitioner is not None and len(sizes) * k <= PARTITIONER_LIMIT:  # verl's KK: rows x k Python objects
            bins = [list(p) for p in partitioner(sizes, k) if len(p)]
            if len(bins) <= k and fits(bins, sizes, cap):
                return BinPacking(bins, lower)
    return BinPacking(bfd, min(lower, len(bfd)))
