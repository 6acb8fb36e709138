"""DP balancing inside a mini-batch: equal row counts per rank, minimal slowest-rank workload.

Workload models (per row of ``L`` attended tokens):
  * ``"verl"``: ``24576 * L + L**2`` -- the formula of verl's ``calculate_workload``
    (``verl/utils/seqlen_balancing.py``: dense-transformer FLOPs for hidden size 4096, up to a constant),
    reimplemented here because the core must not import verl;
  * ``"tokens"``: ``L``.

Balancing is an equal-cardinality multiway partition per mini-batch. :func:`balance_equal_size` runs
(1) a round-based LPT: items sorted by cost, descending, are dealt ``dp`` at a time, the largest item
of a round going to the currently lightest rank -- every rank gets exactly one item per round, so row
counts are equal by construction -- vectorised over all mini-batches at once (one numpy step per
round), then (2) a pairwise-swap refinement per mini-batch: repeatedly swap one item of the heaviest
rank with one item of another rank whose cost difference is closest to half of their load gap
(searchsorted, vectorised over the heavy rank's items), while that lowers the heaviest rank.
"""

from __future__ import annotations

import heapq
from typing import Literal, Optional

import numpy as np
import torch

from verl_traj.core.errors import TrajInputError
from verl_traj.core.sorting import lex_order

__all__ = ["WORKLOAD_MODELS", "calculate_workload", "balance_equal_size", "lpt", "round_robin_equal_size"]

WORKLOAD_MODELS = ("verl", "tokens")
WorkloadModel = Literal["verl", "tokens"]


def calculate_workload(num_tokens: np.ndarray | torch.Tensor, model: WorkloadModel = "verl") -> np.ndarray:
    """Relative cost of each row. ``num_tokens`` ``[N]`` int -> ``[N]`` int64 (float64 never needed:
    ``24576*L + L**2`` stays below 2**63 for any realistic L and sums of up to ~1e8 such rows)."""
    lengths = num_tokens.detach().cpu().numpy() if isinstance(num_tokens, torch.Tensor) else np.asarray(num_tokens)
    lengths = lengths.astype(np.int64, copy=False)
    if model == "verl":
        return 24576 * lengths + lengths * lengths
    if model == "tokens":
        return lengths.copy()
    raise TrajInputError(f"workload={model!r} is not a workload model. Fix: choose one of {WORKLOAD_MODELS}.",
                         field="workload")


def lpt(costs: np.ndarray, num_bins: int, *, order: Optional[np.ndarray] = None,
        bin_rank: Optional[np.ndarray] = None, quota: Optional[np.ndarray] = None) -> np.ndarray:
    """Longest processing time first: items in ``order`` (default: ``costs`` descending, stable) each to the
    lightest bin with quota left; among equally loaded bins the one with fewer items, then the lowest
    ``bin_rank`` (default: the bin index). Unequal counts per bin (unlike :func:`balance_equal_size`).

    Args:
        costs: ``[N]`` int64 cost per item (>= 0).
        quota: ``[num_bins]`` int most items per bin (``quota.sum() >= N``), None for no limit.
    Returns:
        ``[N]`` int64 bin of each item. With ``N >= num_bins`` no bin is empty (the fewer-items tie-break),
        even with zero-cost items.
    """
    costs = np.asarray(costs, dtype=np.int64)
    order = np.argsort(-costs, kind="stable") if order is None else order
    rank = np.arange(num_bins) if bin_rank is None else bin_rank
    left = None if quota is None else np.asarray(quota, dtype=np.int64).copy()
    heap = [(0, 0, int(rank[b]), b) for b in range(num_bins)]
    heapq.heapify(heap)
    assign = np.empty(costs.shape[0], dtype=np.int64)
    for i, c in zip(order.tolist(), costs[order].tolist()):
        load, n, r, b = heapq.heappop(heap)
        assign[i] = b
        if left is not None:
            left[b] -= 1
            if left[b] == 0:
                continue  # quota reached: the bin is never offered again
        heapq.heappush(heap, (load + c, n + 1, r, b))
    return assign


def round_robin_equal_size(block: np.ndarray, num_blocks: int, num_bins: int) -> np.ndarray:
    """No balancing: the i-th item of block g (in input order) goes to bin ``i % num_bins``.

    Args:
        block: ``[N]`` int block (mini-batch) of each item; every block's size divisible by ``num_bins``.
    Returns:
        ``[N]`` int64 bin of each item.
    """
    order = np.argsort(block, kind="stable")
    sizes = np.bincount(block, minlength=num_blocks)
    starts = np.cumsum(sizes) - sizes
    pos = np.empty(block.shape[0], dtype=np.int64)
    pos[order] = np.arange(block.shape[0], dtype=np.int64) - np.repeat(starts, sizes)
    return pos % num_bins


def balance_equal_size(
    costs: np.ndarray,
    block: np.ndarray,
    num_blocks: int,
    num_bins: int,
    *,
    tiebreak: np.ndarray | None = None,
    max_swaps: int | None = None,
    rel_tol: float = 1e-4,
) -> np.ndarray:
    """Split every block's items over ``num_bins`` bins with equal counts, minimising each block's max bin load.

    Args:
        costs: ``[N]`` int64 cost per item (>= 0).
        block: ``[N]`` int block of each item (0..num_blocks-1); each block size divisible by ``num_bins``.
        tiebreak: ``[N]`` optional key ordering equal costs (seed-deterministic plans pass a permutation).
        max_swaps: refinement swaps per block (default ``8 * num_bins + 64``).
        rel_tol: refinement stops once the max bin is within ``rel_tol`` of ``max(ceil(total/bins), max item)``.
    Returns:
        ``[N]`` int64 bin of each item. Invariant: for every block every bin holds ``size / num_bins`` items.
    """
    n = costs.shape[0]
    costs = costs.astype(np.int64, copy=False)
    sizes = np.bincount(block, minlength=num_blocks)
    if np.any(sizes % num_bins):
        raise TrajInputError(f"block sizes {sizes.tolist()} are not all divisible by num_bins={num_bins}. Fix: give "
                             "every block a multiple of num_bins items (the planner pads each mini-batch).",
                             field="block")
    if num_bins == 1:
        return np.zeros(n, dtype=np.int64)
    order = lex_order(np.arange(n) if tiebreak is None else tiebreak, -costs, block)
    bins, loads = _round_lpt(costs, block, order, sizes, num_bins)
    starts = np.cumsum(sizes) - sizes
    max_swaps = 8 * num_bins + 64 if max_swaps is None else max_swaps
    for g in np.flatnonzero(sizes > num_bins):  # one item per bin: no count-preserving swap helps
        idx = order[starts[g]: starts[g] + sizes[g]]
        _refine_block(idx, costs, bins, loads[g], num_bins, max_swaps, rel_tol)
    return _no_worse_than_round_robin(bins, costs, block, num_blocks, num_bins)


def _no_worse_than_round_robin(bins: np.ndarray, costs: np.ndarray, block: np.ndarray, num_blocks: int,
                               num_bins: int) -> np.ndarray:
    """``bins``, except in blocks where no balancing (:func:`round_robin_equal_size`) has a lighter max bin: LPT
    and the refinement are heuristics, and a balanced plan must never be worse than an unbalanced one."""
    rr = round_robin_equal_size(block, num_blocks, num_bins)

    def max_load(assign: np.ndarray) -> np.ndarray:
        loads = np.bincount(block * num_bins + assign, weights=costs, minlength=num_blocks * num_bins)
        return loads.reshape(num_blocks, num_bins).max(1)

    worse = max_load(bins) > max_load(rr)
    return np.where(worse[block], rr, bins)


def _round_lpt(costs: np.ndarray, block: np.ndarray, order: np.ndarray, sizes: np.ndarray,
               num_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Round-based LPT vectorised over blocks: items of a block sorted by cost are dealt ``num_bins`` at
    a time, the largest of a round to the lightest bin. Returns (``[N]`` bins, ``[G, num_bins]`` loads)."""
    num_blocks = sizes.shape[0]
    starts = np.cumsum(sizes) - sizes
    pos = np.arange(costs.shape[0], dtype=np.int64) - np.repeat(starts, sizes)
    g_sorted, j_sorted, i_sorted = block[order], pos // num_bins, pos % num_bins
    max_rounds = int((sizes // num_bins).max()) if num_blocks else 0
    # grid[g, j, i]: i-th largest item of round j of block g (0 beyond the block's rounds)
    grid_cost = np.zeros((num_blocks, max_rounds, num_bins), dtype=np.int64)
    grid_cost[g_sorted, j_sorted, i_sorted] = costs[order]
    grid_bin = np.zeros_like(grid_cost)
    loads = np.zeros((num_blocks, num_bins), dtype=np.int64)
    rows = np.arange(num_blocks)[:, None]
    for j in range(max_rounds):
        b = np.argsort(loads, axis=1, kind="stable")  # lightest bin first; ties -> lower bin index
        grid_bin[:, j, :] = b
        loads[rows, b] += grid_cost[:, j, :]
    bins = np.empty(costs.shape[0], dtype=np.int64)
    bins[order] = grid_bin[g_sorted, j_sorted, i_sorted]
    return bins, loads


def _refine_block(
    idx: np.ndarray, costs: np.ndarray, bins: np.ndarray, loads: np.ndarray, num_bins: int, max_swaps: int, rel_tol: float
) -> None:
    """In-place swap refinement of one block (``idx``: its items; ``loads``: ``[num_bins]`` its bin loads):
    swap one item of the heaviest bin with one of another bin while that lowers the heaviest bin."""
    item_cost = costs[idx]
    item_bin = bins[idx].copy()
    lower = max(-(-int(loads.sum()) // num_bins), int(item_cost.max()))
    good_enough = lower + int(lower * rel_tol)
    for _ in range(max_swaps):
        h = int(np.argmax(loads))
        if loads[h] <= good_enough:
            break
        best = _best_swap(h, item_cost, item_bin, loads)
        if best is None or best[0] >= loads[h]:
            break
        _, a, b, other = best
        d = int(item_cost[a] - item_cost[b])
        loads[h] -= d
        loads[other] += d
        item_bin[a], item_bin[b] = other, h
    bins[idx] = item_bin


def _best_swap(h: int, item_cost: np.ndarray, item_bin: np.ndarray, loads: np.ndarray):
    """Best (new pair max, item of bin h, item of other bin, other bin) over bins lightest first, or None.
    For each other bin ``l`` the partner is found by ``searchsorted``: ``cost_b ~ cost_a - gap / 2``."""
    in_h = np.flatnonzero(item_bin == h)
    wa = item_cost[in_h]
    best = None
    for other in np.argsort(loads, kind="stable").tolist():
        if other == h:
            continue
        gap = int(loads[h] - loads[other])
        if gap <= 1 or (best is not None and loads[other] + (gap + 1) // 2 >= best[0]):
            break  # visited lightest first: no later bin can beat the best found
        in_l = np.flatnonzero(item_bin == other)
        wb_order = np.argsort(item_cost[in_l], kind="stable")
        wb = item_cost[in_l][wb_order]
        k = np.searchsorted(wb, wa - gap / 2.0)
        for kk in (k - 1, k):
            kc = np.clip(kk, 0, wb.shape[0] - 1)
            d = wa - wb[kc]
            valid = (kk >= 0) & (kk < wb.shape[0]) & (d > 0) & (d < gap)
            if not valid.any():
                continue
            newmax = np.where(valid, np.maximum(loads[h] - d, loads[other] + d), np.iinfo(np.int64).max)
            a = int(np.argmin(newmax))
            if best is None or int(newmax[a]) < best[0]:
                best = (int(newmax[a]), int(in_h[a]), int(in_l[wb_order[int(kc[a])]]), other)
    return best
