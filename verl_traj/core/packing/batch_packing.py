"""Every block's micro-batches at a given count in one batch-wide pass: the planner's fast path.

Users' blocks (one rank's rows of a mini-batch) hold hundreds to thousands of rows, each far under the cap,
and the planner balances ranks by tokens, so a block's rows fill ``ceil(tokens / cap)`` micro-batches within a
few tokens each: a tight packing, but one with many rows to exchange. :func:`pack_blocks` finds it for all
blocks at once, as array work:

1. longest-processing-time (LPT) in rounds (:func:`_lpt_rounds`): round ``r`` hands each block's next ``k`` rows
   (``k`` its bins, rows longest first) to its ``k`` bins, the longest to the least-loaded bin (``rows / bins``
   rounds, each over ``[blocks, bins]``);
2. a swap repair (:func:`_swap_repair`): each round pairs every over-full bin with up to ``_FAN`` under-full bins of
   its block (each under-full bin in one pair) and makes the one exchange of a row each (or a move of one row) that
   takes the most of the excess without over-filling the partner. Rounds stop when every bin fits or ``rounds`` ran
   out; the total over-fill never rises.

Blocks it leaves over-full are the caller's (an exact search per block, or one more bin). Pure module (numpy).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from verl_traj.core.sorting import lex_order

__all__ = ["MAX_EXTRA_BINS", "REPAIR_ROUNDS", "BatchPacking", "pack_blocks", "pack_fewest"]

REPAIR_ROUNDS = 64  # swap-repair rounds; users' blocks settle in 20-40
MAX_EXTRA_BINS = 8  # pack_fewest: more bins tried batch-wide on blocks too large for an exact search
_EMPTY = -1
_NEVER = 1 << 30  # stands for a slot no exchange may use
_FAN = 16  # under-full partners an over-full bin tries in one round, where there are enough
_SHIFT = 7919  # a prime: round r pairs the i-th over-full bin with under-full bin i + r * _SHIFT (mod count)


@dataclass(frozen=True)
class BatchPacking:
    """Result of :func:`pack_blocks`.

    bin: ``[N]`` int64 bin of each row within its block (``0..bins[b]-1``), rows as given.
    fits: ``[B]`` bool, every bin of the block holds at most ``cap`` tokens.
    """

    bin: np.ndarray
    fits: np.ndarray


def _lpt_rounds(sizes: np.ndarray, starts: np.ndarray, counts: np.ndarray, bins: np.ndarray) -> np.ndarray:
    """``[N]`` bin of each row: LPT in rounds, all blocks at once. Round ``r`` hands each block's next ``k`` rows
    (``k``: its bins; longest first) to its bins, the longest row to the least-loaded bin, and so on: the spread of
    a block's loads stays at most its longest row, as with LPT (``ceil(rows / bins)`` rounds)."""
    width = int(bins.max())
    col = np.arange(width)[None, :]
    unused = col >= bins[:, None]  # bins a block does not have: sort last, never filled
    loads = np.where(unused, np.iinfo(np.int64).max // 2, 0)
    assign = np.zeros(sizes.size, dtype=np.int64)
    every = np.arange(counts.size)[:, None]
    for r in range(int((-(-counts // bins)).max())):
        offset = r * bins[:, None] + col
        valid = ~unused & (offset < counts[:, None])
        pos = np.where(valid, starts[:, None] + offset, 0)
        target = np.argsort(loads, axis=1, kind="stable")
        loads[every, target] += np.where(valid, sizes[pos], 0)
        assign[pos[valid]] = target[valid]
    return assign


def _slots(bin_of_row: np.ndarray, num_bins: int, spare: int) -> np.ndarray:
    """``[G, W]`` row ids of each global bin (``_EMPTY`` where free), ``spare`` free slots beyond the fullest."""
    order = np.argsort(bin_of_row, kind="stable")
    count = np.bincount(bin_of_row, minlength=num_bins)
    first = np.cumsum(count) - count
    slots = np.full((num_bins, int(count.max(initial=0)) + spare), _EMPTY, dtype=np.int64)
    slots[bin_of_row[order], np.arange(order.size) - first[bin_of_row[order]]] = order
    return slots


def _pairs(excess: np.ndarray, bin_block: np.ndarray, num_blocks: int, shift: int) -> tuple[np.ndarray, np.ndarray]:
    """Over-full bins paired with under-full bins of the same block: ``(h, t)`` global bin ids (bins are
    block-major), each under-full bin in at most one pair, each over-full bin in ``f = min(_FAN, u // o)`` pairs
    (``o`` over-full, ``u`` under-full bins in its block; the over-full bins past ``u`` wait). The ``i``-th
    over-full bin takes under-full bins ``(i + j o + shift) mod u``, ``j < f``: a new ``shift`` each round pairs
    them differently. No sort; pairs of one over-full bin are consecutive."""
    over, under = np.flatnonzero(excess > 0), np.flatnonzero(excess < 0)
    n_under = np.bincount(bin_block[under], minlength=num_blocks)
    n_over = np.minimum(np.bincount(bin_block[over], minlength=num_blocks), n_under)
    first = np.cumsum(n_under) - n_under
    block = bin_block[over]
    rank = np.arange(over.size) - np.searchsorted(block, block)
    waits = rank >= n_under[block]
    over, block, rank = over[~waits], block[~waits], rank[~waits]
    fan = np.clip(n_under[block] // np.maximum(n_over[block], 1), 1, _FAN)
    j = np.arange(int(fan.sum())) - np.repeat(np.cumsum(fan) - fan, fan)
    over, block, rank = np.repeat(over, fan), np.repeat(block, fan), np.repeat(rank, fan)
    return over, under[first[block] + (rank + j * n_over[block] + shift) % np.maximum(n_under[block], 1)]


def _segment_argmax(values: np.ndarray, first: np.ndarray) -> np.ndarray:
    """Position of the largest of ``values`` in each segment (segments start at ``first``), relative to it."""
    if first.size == values.size:
        return np.zeros(first.size, dtype=np.int64)
    seg = np.repeat(np.arange(first.size), np.diff(np.concatenate([first, [values.size]])))
    return lex_order(-values, seg)[first] - first


def _swap_repair(sizes: np.ndarray, slots: np.ndarray, loads: np.ndarray, bin_block: np.ndarray, cap: int,
                 rounds: int) -> None:
    """Rounds of one exchange per (over-full, under-full) pair, in place on ``slots`` / ``loads`` (module
    docstring). An exchange moves ``d = a - c`` tokens (``c = 0``: a move into a free slot) with
    ``1 <= d <= room``: the partner still fits and the excess shrinks by ``min(d, excess)``, the most taken."""
    small = 3 * cap < _NEVER  # scores stay under 3 x cap: int32 halves the traffic where that fits
    sized = np.concatenate([sizes, [0]]).astype(np.int32 if small else np.int64)  # _EMPTY (-1) reads 0
    num_blocks = int(bin_block[-1]) + 1
    for r in range(rounds):
        excess = loads - cap
        h, t = _pairs(excess, bin_block, num_blocks, r * _SHIFT)
        if h.size == 0:
            return
        free = slots[t] == _EMPTY  # one free slot of t stands for all: the others never take a row
        c = np.where(free & (free.cumsum(1) > 1), _NEVER if small else 1 << 62, sized[slots[t]])
        d = sized[slots[h]][:, :, None] - c[:, None, :]  # [P, W, W]; an empty slot of h gives d <= 0
        e = excess[h].astype(sized.dtype)[:, None, None]
        room = (-excess[t]).astype(sized.dtype)[:, None, None]
        # prefer d >= e (the excess all gone), the least such d; else the largest d
        score = np.where((d >= 1) & (d <= room), np.where(d >= e, 2 * cap + e - d, d), -1).reshape(h.size, -1)
        best = score.argmax(1)
        top = score[np.arange(h.size), best]
        first = np.flatnonzero(np.concatenate([[True], h[1:] != h[:-1]]))  # each over-full bin's pairs
        pick = first + _segment_argmax(top, first)
        ok = top[pick] >= 0
        h, t, best = h[pick][ok], t[pick][ok], best[pick][ok]
        ai, ci = np.divmod(best, slots.shape[1])
        row_a, row_c = slots[h, ai], slots[t, ci]
        moved = sized[row_a] - sized[row_c]
        slots[h, ai], slots[t, ci] = row_c, row_a
        loads[h] -= moved
        loads[t] += moved


def pack_blocks(sizes: np.ndarray, starts: np.ndarray, counts: np.ndarray, bins: np.ndarray, cap: int, *,
                rounds: int = REPAIR_ROUNDS) -> BatchPacking:
    """Every block's rows into its ``bins`` bins of ``cap`` tokens (module docstring).

    Args:
        sizes: ``[N]`` int64 tokens per row, grouped by block, each block's rows longest first.
        starts: ``[B]`` int64 first row of each block; counts: ``[B]`` int64 its rows (contiguous, in order).
        bins: ``[B]`` int64 bins of each block (>= 1 where it has rows).
    Invariants: no Python loop over rows or blocks; ``O(max rows a block)`` LPT steps plus ``rounds`` repair
    rounds, each array work over the blocks' bins.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    live = counts > 0
    if not live.any():
        return BatchPacking(np.zeros(sizes.size, dtype=np.int64), np.ones(counts.size, dtype=bool))
    bins = np.where(live, bins, 0)
    assign = _lpt_rounds(sizes, starts[live], counts[live], bins[live])
    offset = np.cumsum(bins) - bins
    row_block = np.repeat(np.arange(counts.size), counts)
    global_bin = offset[row_block] + assign
    loads = np.bincount(global_bin, weights=sizes, minlength=int(bins.sum())).astype(np.int64)
    slots = _slots(global_bin, loads.size, spare=2)
    bin_block = np.repeat(np.arange(counts.size), bins)
    _swap_repair(sizes, slots, loads, bin_block, cap, rounds)
    filled = slots != _EMPTY
    global_bin[slots[filled]] = np.nonzero(filled)[0]
    fits = np.ones(counts.size, dtype=bool)
    np.logical_and.at(fits, bin_block, loads <= cap)
    return BatchPacking(global_bin - offset[row_block], fits)


def pack_fewest(sizes: np.ndarray, starts: np.ndarray, counts: np.ndarray, cap: int, search_limit: int,
                extra: int = MAX_EXTRA_BINS) -> tuple[BatchPacking, np.ndarray, np.ndarray]:
    """:func:`pack_blocks` at each block's token bound ``max(1, ceil(tokens / cap))``; blocks with
    ``rows x bins > search_limit`` (too large for the caller's exact search) that do not fit get one more bin and
    are packed again (only they), up to ``extra`` more.

    Returns ``(packing, bins, bound)``: ``bins`` ``[B]`` int64 the count each block was packed at and ``bound``
    ``[B]`` its token bound (both 0 when empty); ``packing.fits[b]`` says whether that count fits (the caller
    packs the others its own way)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    prefix = np.concatenate([[0], np.cumsum(sizes)])
    bound = np.where(counts > 0, np.maximum(1, -(-(prefix[starts + counts] - prefix[starts]) // cap)), 0)
    bins = bound.copy()
    result = pack_blocks(sizes, starts, counts, bins, cap)
    assign, fits = result.bin.copy(), result.fits.copy()
    retry = counts * bins > search_limit
    for _ in range(extra):
        again = np.flatnonzero(~fits & retry)
        if again.size == 0:
            break
        bins[again] += 1
        rows = np.concatenate([np.arange(s, s + n) for s, n in zip(starts[again].tolist(), counts[again].tolist())])
        sub = pack_blocks(sizes[rows], np.cumsum(counts[again]) - counts[again], counts[again], bins[again], cap)
        assign[rows], fits[again] = sub.bin, sub.fits
    return BatchPacking(assign, fits), bins, bound
