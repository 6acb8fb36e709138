"""Token-capped micro-batch packing per (mini-batch, rank) block: the forward/backward passes that run.

A mini-batch is one optimizer step; packing only decides how one rank's rows of a mini-batch are cut
into forward/backward passes, so it never changes the gradient (the losses carry mini-batch-global
weights). The cost of a micro-batch depends on the attention path:

* ``cost="tokens"`` (remove-padding / varlen attention, verl's GPU default): a micro-batch costs the
  sum of its rows' attended tokens. Objective: the fewest micro-batches whose token sums fit ``cap``.
  Per block the count starts at the lower bound ``ceil(tokens / cap)`` and rises until one of these
  fits: longest-processing-time (LPT, balanced), best-fit decreasing (BFD), an optional caller-given
  partitioner (the verl adapter passes verl's own Karmarkar-Karp, so the count is never above verl's
  ``rearrange_micro_batches`` on the same rows), and, for blocks of at most ``EXACT_MAX_ROWS`` rows,
  an exact depth-first search with a node budget (the optimum wherever that search is cheap).
* ``cost="padded"`` (no remove-padding, e.g. sdpa on CPU): every micro-batch is padded to its longest
  row, so its compute is ``rows x longest row`` positions, and every pass also has a fixed cost
  (``pass_cost``, in positions: kernel launches, FSDP's parameter gathers). The cap keeps verl's meaning
  (the rows' token sum). From the token cost's count (never above verl's on the same rows) upward, the
  block takes the cut with the least ``padded area + count x pass_cost`` among: consecutive runs of
  length-sorted rows whose token sums fit (a dynamic program; consecutive runs are optimal for this area)
  and, at the token cost's count, that packing and the partitioner's (verl's) own cut -- so at verl's count
  its padded positions are never above verl's. ``pass_cost=None`` keeps the token cost's count.
* ``cost="padded_area"``: as ``"padded"`` but the cap bounds the padded area itself (a strict memory
  bound): the count is the fewest consecutive length-sorted runs whose area fits (a greedy cut finds it),
  or the partitioner's count if that is more; the runs are the least-area ones at that count. More,
  smaller passes than verl where verl's micro-batches would exceed the cap once padded.

Then, as verl's engines expect the same number of micro-batches on every DP rank of a mini-batch
(FSDP's gradient sync runs on the last one), every block of a sync set is brought to the set's
largest count: the padded cost re-cuts the block's least-area runs at that count, the token cost
splits its micro-batch with the largest cost in two. Every rank holds the same
number of rows of a mini-batch (the planner's invariant), so a block can always be split that far
when the synced count does not exceed its rows; ``ranks_short_of_rows`` counts the blocks where it
cannot (kept as a guard metric; it stays 0 for verl_traj plans).
"""

from __future__ import annotations

import bisect
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Sequence

import numpy as np

from .balancing import lpt
from .errors import TrajInputError, check_choice, check_index, check_int

__all__ = [
    "EXACT_MAX_ROWS",
    "MICRO_BATCH_COSTS",
    "MicroBatchPacking",
    "PackingError",
    "Partitioner",
    "min_micro_batches",
    "pack_micro_batches",
]

MICRO_BATCH_COSTS = ("tokens", "padded", "padded_area")
EXACT_MAX_ROWS = 24  # blocks up to this many rows get the exact search
EXACT_NODE_BUDGET = 20_000
Cost = Literal["tokens", "padded", "padded_area"]
# (row lengths, number of parts) -> parts as lists of row positions (may return parts over the cap)
Partitioner = Callable[[list[int], int], Sequence[Sequence[int]]]


class PackingError(TrajInputError):
    """The token cap cannot be met (a single row is longer than the cap)."""


@dataclass(frozen=True)
class MicroBatchPacking:
    """Result of :func:`pack_micro_batches`.

    micro_index: ``[N]`` int64 micro-batch of each row within its block (0..count-1).
    block_count: ``[num_blocks]`` int64 micro-batches of each block (after the DP sync).
    block_count_unsynced: ``[num_blocks]`` int64 fewest micro-batches found per block.
    block_lower_bound: ``[num_blocks]`` int64 ``ceil(cost / cap)``: no packing of the block needs fewer.
    ranks_short_of_rows: ``[num_blocks]`` bool, block has fewer rows than its sync set's count.
    """

    micro_index: np.ndarray
    block_count: np.ndarray
    block_count_unsynced: np.ndarray
    block_lower_bound: np.ndarray
    ranks_short_of_rows: np.ndarray


def _check_cap(tokens: np.ndarray, cap: int) -> None:
    if tokens.size and int(tokens.max()) > cap:
        raise PackingError(
            f"micro_batch_max_tokens={cap} is below the longest row ({int(tokens.max())} tokens). "
            "Fix: raise the micro-batch token cap to at least the max prompt+response length "
            "(a row cannot be split across micro-batches).", field="micro_batch_max_tokens",
        )


def _checked_inputs(tokens: Any, block: Any, block_sync: Any, num_blocks: Any, cap: Any, cost: Any,
                    partitioner: Any, pass_cost: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """:func:`pack_micro_batches`' inputs checked (one pass each): ``(tokens, block, block_sync, num_blocks, cap)``."""
    check_choice("cost", cost, MICRO_BATCH_COSTS, error=PackingError)
    num_blocks = check_int("num_blocks", num_blocks, "pass mini-batches x dp_size", minimum=0, error=PackingError)
    cap = check_int("micro_batch_max_tokens", cap, "set the micro-batch cap to an int >= 1 (tokens, or padded "
                    "positions with cost='padded_area')", minimum=1, error=PackingError)
    tok = check_index("tokens", tokens, "pass each row's attended tokens as whole numbers >= 0", error=PackingError)
    blk = check_index("block", block, f"pass each row's block (mini_batch * dp + rank) in [0, {num_blocks})",
                      rows=tok.shape[0], high=num_blocks, error=PackingError)
    sync = check_index("block_sync", block_sync, "pass each block's sync set (its mini-batch), one per block",
                       rows=num_blocks, error=PackingError)
    if partitioner is not None and not callable(partitioner):
        raise PackingError.invalid("partitioner", partitioner, "is not callable", "pass fn(sizes, k) -> parts, or None")
    if pass_cost is not None and (isinstance(pass_cost, (bool, np.bool_)) or not isinstance(pass_cost, numbers.Real)
                                  or not 0 <= float(pass_cost) < math.inf):
        raise PackingError.invalid("pass_cost", pass_cost, "is not a finite number >= 0",
                                   "give the padded positions of one pass, or None")
    return tok.numpy(), blk.numpy(), sync.numpy(), num_blocks, cap


def _bins_of(assign: Sequence[int], k: int) -> list[list[int]]:
    bins: list[list[int]] = [[] for _ in range(k)]
    for i, b in enumerate(assign):
        bins[b].append(i)
    return [b for b in bins if b]


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


def _lpt(sizes: list[int], k: int) -> list[list[int]]:
    """:func:`~verl_traj.core.balancing.lpt` of ``sizes`` (sorted descending) over ``k`` bins, as bins of positions."""
    assign = lpt(np.asarray(sizes, dtype=np.int64), k, order=np.arange(len(sizes)))
    return [b.tolist() for b in (np.flatnonzero(assign == j) for j in range(k)) if b.size]


def _exact(sizes: list[int], k: int, cap: int, budget: int = EXACT_NODE_BUDGET) -> Optional[list[list[int]]]:
    """Depth-first search for a packing of ``sizes`` (sorted descending) into ``k`` bins of ``cap``.
    Equal-load bins are tried once (symmetry). Returns None when none exists or the budget ran out."""
    n = len(sizes)
    loads = [0] * k
    assign = [0] * n
    nodes = [0]
    suffix = np.concatenate([np.cumsum(sizes[::-1])[::-1], [0]]).tolist()

    def place(i: int) -> bool:
        if i == n:
            return True
        nodes[0] += 1
        if nodes[0] > budget or suffix[i] > k * cap - sum(loads):
            return False
        tried: set[int] = set()
        for b in range(k):
            if loads[b] in tried or loads[b] + sizes[i] > cap:
                continue
            tried.add(loads[b])
            loads[b] += sizes[i]
            assign[i] = b
            if place(i + 1):
                return True
            loads[b] -= sizes[i]
        return False

    return _bins_of(assign, k) if place(0) else None


def _fits(bins: Sequence[Sequence[int]], sizes: list[int], cap: int) -> bool:
    return all(sum(sizes[i] for i in b) <= cap for b in bins)


def min_micro_batches(sizes: list[int], cap: int, partitioner: Optional[Partitioner] = None) -> list[list[int]]:
    """Fewest micro-batches (token-sum cost) for one block; ``sizes`` sorted descending.
    Returns bins of positions into ``sizes``. See the module docstring for the methods tried."""
    bfd = _best_fit_decreasing(sizes, cap)
    lower = max(1, -(-sum(sizes) // cap))
    for k in range(lower, len(bfd)):
        candidates = [_lpt(sizes, k)]
        if partitioner is not None:
            candidates.append([list(p) for p in partitioner(sizes, k) if len(p)])
        for bins in candidates:
            if len(bins) <= k and _fits(bins, sizes, cap):
                return bins
        if len(sizes) <= EXACT_MAX_ROWS:
            bins = _exact(sizes, k, cap)
            if bins is not None:
                return bins
    return bfd


def _padded_runs(sizes: list[int], cap: int) -> list[list[int]]:
    """``sizes`` sorted descending cut greedily into consecutive runs with ``len(run) * run[0] <= cap``:
    the fewest runs."""
    bins: list[list[int]] = []
    i = 0
    while i < len(sizes):
        take = max(1, cap // sizes[i])
        bins.append(list(range(i, min(i + take, len(sizes)))))
        i += take
    return bins


def _least_area_runs(sizes: list[int], cap: int, k: int, bound: Literal["tokens", "area"], *,
                     k_max: Optional[int] = None, pass_cost: float = 0.0) -> Optional[list[list[int]]]:
    """Consecutive runs of ``sizes`` (sorted descending), each run's token sum (``bound="tokens"``) or area
    (``"area"``) ``<= cap``, with the least padded area ``sum(len(run) * run[0])`` -- exactly ``k`` runs, or,
    with ``k_max``, the count in ``[k, k_max]`` with the least ``area + count * pass_cost``. None when no count
    in range covers the rows.

    Runs of consecutive rows in length order are optimal for this area, so a dynamic program over (runs, rows
    covered) finds the optimum: ``O(count n^2)``, vectorised over the run's start. Its cost satisfies the
    quadrangle inequality, so the least area is convex in the count and the scan stops once the objective rises."""
    n = len(sizes)
    k_max = min(k if k_max is None else k_max, n)
    length = np.asarray(sizes, dtype=np.float64)
    start, end = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
    area = (end - start) * np.concatenate([length, [0.0]])[:, None]  # run rows start..end-1 costs (end-start)*L[start]
    prefix = np.concatenate([[0.0], np.cumsum(length)])
    load = area if bound == "area" else prefix[None, :] - prefix[:, None]
    area = np.where((end > start) & (load <= cap), area, np.inf)
    best, back, chosen, chosen_cost = np.full(n + 1, np.inf), [], None, np.inf
    best[0] = 0.0
    columns = np.arange(n + 1)
    for count in range(1, k_max + 1):
        cand = best[:, None] + area
        back.append(cand.argmin(0))
        best = cand[back[-1], columns]
        objective = best[n] + count * pass_cost
        if count >= k and objective < chosen_cost:
            chosen, chosen_cost = count, objective
        elif chosen is not None and objective > chosen_cost:
            break
    if chosen is None:
        return None
    bounds, i = [n], n
    for arg in reversed(back[:chosen]):
        i = int(arg[i])
        bounds.append(i)
    bounds.reverse()
    return [list(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:])]


def _bin_cost(b: Sequence[int], sizes: list[int], cost: Cost) -> int:
    return sum(sizes[i] for i in b) if cost == "tokens" else len(b) * max(sizes[i] for i in b)


def _area(bins: Sequence[Sequence[int]], sizes: list[int]) -> int:
    return sum(_bin_cost(b, sizes, "padded") for b in bins)


def _split_to(bins: list[list[int]], want: int, sizes: list[int], cost: Cost) -> list[list[int]]:
    """Split the costliest multi-row bin in two (rows alternate, so both halves stay under the cap
    and, for the padded costs, each half keeps rows of similar length) until ``want`` bins."""
    bins = [sorted(b) for b in bins]
    while len(bins) < want:
        splittable = [j for j, b in enumerate(bins) if len(b) > 1]
        if not splittable:
            break
        j = max(splittable, key=lambda j: (_bin_cost(bins[j], sizes, cost), len(bins[j])))
        rows = bins[j]
        if cost != "tokens":  # keep runs contiguous in length order: first half / second half
            half = len(rows) // 2
            bins[j], new = rows[:half], rows[half:]
        else:
            bins[j], new = rows[0::2], rows[1::2]
        bins.append(new)
    return bins


def _partitioner_count(sizes: list[int], cap: int, partitioner: Partitioner) -> int:
    """The fewest parts the partitioner (verl's own cut) needs for its token sums to fit ``cap``."""
    return next(k for k in range(max(1, -(-sum(sizes) // cap)), len(sizes) + 1)
                if _fits([p for p in partitioner(sizes, k) if len(p)], sizes, cap))


def _pack_padded(sizes: list[int], cap: int, partitioner: Optional[Partitioner],
                 pass_cost: Optional[float]) -> list[list[int]]:
    """``cost="padded"``: from the token cost's count up, the cut with the least ``padded area + count x
    pass_cost`` (``pass_cost=None``: the token cost's count only; see the module docstring). verl's own cut (an
    O(n log n) Python heap per call) is tried only when it could pad less than the consecutive runs found:
    no cut into ``k`` parts pads less than the unconstrained least-area runs at ``k``."""
    fewest = min_micro_batches(sizes, cap, partitioner)
    k, cost = len(fewest), pass_cost or 0.0
    k_max = k if pass_cost is None else len(sizes)
    candidates = [fewest, _least_area_runs(sizes, cap, k, "tokens", k_max=k_max, pass_cost=cost)]
    best = min((c for c in candidates if c is not None), key=lambda c: _area(c, sizes) + len(c) * cost)
    if partitioner is not None:
        floor = _least_area_runs(sizes, math.inf, k, "area")
        if floor is not None and _area(best, sizes) + len(best) * cost > _area(floor, sizes) + k * cost:
            theirs = [list(p) for p in partitioner(sizes, k) if len(p)]
            if len(theirs) <= k and _fits(theirs, sizes, cap) and _area(theirs, sizes) < _area(best, sizes) + (
                    len(best) - len(theirs)) * cost:
                best = theirs
    return best


def _pack_block(sizes: list[int], cap: int, cost: Cost, partitioner: Optional[Partitioner],
                pass_cost: Optional[float]) -> list[list[int]]:
    """One block's micro-batches under its cost model, before the DP sync (see the module docstring)."""
    if not sizes:
        return []
    if cost == "tokens":
        return min_micro_batches(sizes, cap, partitioner)
    if cost == "padded":
        return _pack_padded(sizes, cap, partitioner, pass_cost)
    bins = _padded_runs(sizes, cap)
    if partitioner is not None:
        k = max(_partitioner_count(sizes, cap, partitioner), len(bins))
        bins = _least_area_runs(sizes, cap, k, "area") or bins
    return bins


def _final_bins(bins: list[list[int]], want: int, sizes: list[int], cap: int, cost: Cost) -> list[list[int]]:
    """A block's micro-batches at its sync set's count: its own where that is the count, else the least-area
    runs at the count (padded costs) or splits."""
    if len(bins) >= want:
        return bins
    if cost != "tokens":
        best = _least_area_runs(sizes, cap, min(want, len(sizes)), "area" if cost == "padded_area" else "tokens")
        if best is not None:
            return best
    return _split_to(bins, want, sizes, cost)


def pack_micro_batches(
    tokens: np.ndarray,
    block: np.ndarray,
    block_sync: np.ndarray,
    num_blocks: int,
    cap: int,
    *,
    cost: Cost = "tokens",
    partitioner: Optional[Partitioner] = None,
    pass_cost: Optional[float] = None,
) -> MicroBatchPacking:
    """Pack every block's rows into micro-batches under ``cap`` with synced counts per sync set.

    Args:
        tokens: ``[N]`` int attended tokens per row (padding rows included: they run a forward pass).
        block: ``[N]`` int block of each row (block = mini_batch * dp + rank).
        block_sync: ``[num_blocks]`` int sync set of each block (its mini-batch): all blocks of one
            sync set end with the same micro-batch count (where they have enough rows).
        cap: per micro-batch: tokens (``cost="tokens"`` and ``"padded"``) or padded positions
            (``cost="padded_area"``).
        partitioner: optional extra candidate, verl's own cut (see :func:`min_micro_batches`).
        pass_cost: ``cost="padded"`` only: the fixed cost of one forward/backward pass in padded positions;
            more micro-batches than the token cost's count are cut where the padded area they save exceeds
            it. ``None``: the token cost's count (at most verl's).
    Raises:
        PackingError: a row is longer than ``cap``; an input of the wrong shape, dtype or range (field: its name).
    """
    tokens, block, block_sync, num_blocks, cap = _checked_inputs(tokens, block, block_sync, num_blocks, cap, cost,
                                                                 partitioner, pass_cost)
    _check_cap(tokens, cap)
    order = np.lexsort((-tokens, block))  # by block, longest first
    sizes_all = np.bincount(block, minlength=num_blocks)
    starts = np.cumsum(sizes_all) - sizes_all
    sorted_tokens = tokens[order].tolist()
    packed = [_pack_block(sorted_tokens[s:s + n], cap, cost, partitioner, pass_cost)
              for s, n in zip(starts.tolist(), sizes_all.tolist())]
    unsynced = np.array([len(p) for p in packed], dtype=np.int64)
    target = np.zeros(int(block_sync.max()) + 1 if num_blocks else 0, dtype=np.int64)
    np.maximum.at(target, block_sync, unsynced)
    want = target[block_sync]
    short = sizes_all < want
    micro_index = np.zeros(tokens.shape[0], dtype=np.int64)
    count = np.zeros(num_blocks, dtype=np.int64)
    for b in range(num_blocks):
        s, n = int(starts[b]), int(sizes_all[b])
        bins = _final_bins(packed[b], int(want[b]), sorted_tokens[s:s + n], cap, cost)
        count[b] = len(bins)
        local = np.empty(n, dtype=np.int64)
        for m, rows in enumerate(bins):
            local[rows] = m
        micro_index[order[s:s + n]] = local
    block_cost = np.zeros(num_blocks, dtype=np.int64)
    np.add.at(block_cost, block, tokens)
    lower = np.maximum(-(-block_cost // cap), (sizes_all > 0).astype(np.int64))
    return MicroBatchPacking(micro_index, count, unsynced, lower, short)
