"""Token-capped micro-batch packing per (mini-batch, rank) block: the forward/backward passes that run.

A mini-batch is one optimizer step; packing only decides how one rank's rows of a mini-batch are cut
into forward/backward passes, so it never changes the gradient (the losses carry mini-batch-global
weights). The cost of a micro-batch depends on the attention path:

* ``cost="tokens"`` (remove-padding / varlen attention, verl's GPU default): a micro-batch costs the
  sum of its rows' attended tokens. Objective: the fewest micro-batches whose token sums fit ``cap``
  (:func:`~verl_traj.core.packing.bin_packing.fewest_bins`: from the Martello-Toth lower bound up, an exact
  bin-completion search under a work budget, then LPT and an optional caller-given partitioner -- the
  verl adapter passes verl's own Karmarkar-Karp, so the count is never above verl's
  ``rearrange_micro_batches`` on the same rows -- and best-fit decreasing). The count equals the block's
  lower bound wherever the exact search settles every smaller count. First, for all blocks at once, LPT in
  rounds at ``ceil(tokens / cap)`` and a swap repair (:func:`~verl_traj.core.packing.batch_packing.pack_fewest`:
  batch-wide array work; a block too large for the exact search gets one more bin batch-wide instead); only
  the blocks it does not fit are packed one by one, so users' large blocks of short rows cost no Python loop
  over rows.
* ``cost="padded"`` (no remove-padding, e.g. sdpa on CPU): every micro-batch is padded to its longest
  row, so its compute is ``rows x longest row`` positions, and every pass also has a fixed cost
  (``pass_cost``, in positions: kernel launches, FSDP's parameter gathers). The cap keeps verl's meaning
  (the rows' token sum). From the token cost's count (never above verl's on the same rows) upward, the
  block takes the cut with the least ``padded area + count x pass_cost`` among: consecutive runs of
  length-sorted rows whose token sums fit (a dynamic program; consecutive runs are optimal for this area)
  and, at the token cost's count, that packing, an exact packing that keeps rows of similar length together
  (:func:`~verl_traj.core.packing.bin_packing.pack_into` with ``fair_first=False``), the least-area runs with the cap
  ignored repaired until they fit (:func:`~verl_traj.core.packing.bin_packing.repaired_bins`) -- where the count is
  tight, consecutive runs do not fit and an arbitrary packing pads much more -- and the partitioner's (verl's)
  own cut -- so at verl's count its padded positions are never above verl's. ``pass_cost=None`` keeps the token
  cost's count.
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

import math
import numbers
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from verl_traj.core.packing.batch_packing import pack_fewest
from verl_traj.core.packing.bin_packing import SEARCH_LIMIT, Partitioner, bin_lower_bound, fewest_bins
from verl_traj.core.errors import TrajInputError, check_choice, check_index, check_int
from verl_traj.core.packing.padded_packing import Cost, least_area_runs, pack_padded, padded_runs, partitioner_count, split_to
from verl_traj.core.sorting import lex_order

__all__ = [
    "MICRO_BATCH_COSTS",
    "MicroBatchPacking",
    "PackingError",
    "Partitioner",
    "min_micro_batches",
    "pack_micro_batches",
]

MICRO_BATCH_COSTS = ("tokens", "padded", "padded_area")


class PackingError(TrajInputError):
    """The token cap cannot be met (a single row is longer than the cap)."""


@dataclass(frozen=True)
class MicroBatchPacking:
    """Result of :func:`pack_micro_batches`.

    micro_index: ``[N]`` int64 micro-batch of each row within its block (0..count-1).
    block_count: ``[num_blocks]`` int64 micro-batches of each block (after the DP sync).
    block_count_unsynced: ``[num_blocks]`` int64 fewest micro-batches found per block.
    block_lower_bound: ``[num_blocks]`` int64 no packing of the block under ``cap`` has fewer micro-batches:
        the Martello-Toth bound (>= ``ceil(tokens / cap)`` and >= the rows over ``cap / 2``), raised where the
        exact search proved a count impossible; the greedy count (the optimum) for ``cost="padded_area"``.
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


def min_micro_batches(sizes: list[int], cap: int, partitioner: Optional[Partitioner] = None) -> list[list[int]]:
    """Fewest micro-batches (token-sum cost) for one block; ``sizes`` sorted descending.
    Returns bins of positions into ``sizes`` (:func:`~verl_traj.core.packing.bin_packing.fewest_bins`)."""
    return fewest_bins(sizes, cap, partitioner).bins


def _pack_block(sizes: list[int], cap: int, cost: Cost, partitioner: Optional[Partitioner],
                pass_cost: Optional[float]) -> tuple[list[list[int]], int]:
    """One block's micro-batches under its cost model, before the DP sync (see the module docstring), and the
    fewest micro-batches any packing of the block under ``cap`` needs (its lower bound; 0 for an empty block)."""
    if not sizes:
        return [], 0
    if cost == "padded_area":  # the greedy count is the optimum
        bins = padded_runs(sizes, cap)
        fewest = len(bins)
        if partitioner is not None:
            k = max(partitioner_count(sizes, cap, partitioner), len(bins))
            bins = least_area_runs(sizes, cap, k, "area") or bins
        return bins, fewest
    packing = fewest_bins(sizes, cap, partitioner)
    if cost == "tokens":
        return packing.bins, packing.lower_bound
    return pack_padded(sizes, packing.bins, cap, partitioner, pass_cost), packing.lower_bound


def _final_bins(bins: list[list[int]], want: int, sizes: list[int], cap: int, cost: Cost) -> list[list[int]]:
    """A block's micro-batches at its sync set's count: its own where that is the count, else the least-area
    runs at the count (padded costs) or splits."""
    if len(bins) >= want:
        return bins
    if cost != "tokens":
        best = least_area_runs(sizes, cap, min(want, len(sizes)), "area" if cost == "padded_area" else "tokens")
        if best is not None:
            return best
    return split_to(bins, want, sizes, cost)


def _batch_wide(sorted_tokens: np.ndarray, starts: np.ndarray, rows: np.ndarray, cap: int,
                cost: Cost) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The token cost's batch-wide pass (:func:`~verl_traj.core.packing.batch_packing.pack_fewest`): ``(local [N] micro-batch
    of each sorted row, done [B], count [B], lower bound [B])``; blocks not ``done`` are packed one by one."""
    if cost != "tokens":
        zeros = np.zeros(rows.size, dtype=np.int64)
        return np.zeros(sorted_tokens.size, dtype=np.int64), zeros.astype(bool), zeros, zeros.copy()
    fast, bins, bound = pack_fewest(sorted_tokens, starts, rows, cap, SEARCH_LIMIT)
    lower = np.where(fast.fits, bins, 0)
    for b in np.flatnonzero(fast.fits & (bins > bound)).tolist():  # fit with more bins: say the bound
        lower[b] = bin_lower_bound(sorted_tokens[starts[b]:starts[b] + rows[b]], cap)
    return fast.bin.copy(), fast.fits.copy(), np.where(fast.fits, bins, 0), lower


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
    order = lex_order(-tokens, block)  # by block, longest first
    rows = np.bincount(block, minlength=num_blocks)
    starts = np.cumsum(rows) - rows
    sorted_tokens = tokens[order]
    local, done, unsynced, lower = _batch_wide(sorted_tokens, starts, rows, cap, cost)
    packed: dict[int, list[list[int]]] = {}
    for b in np.flatnonzero(~done).tolist():
        s, n = int(starts[b]), int(rows[b])
        packed[b], lower[b] = _pack_block(sorted_tokens[s:s + n].tolist(), cap, cost, partitioner, pass_cost)
        unsynced[b] = len(packed[b])
    target = np.zeros(int(block_sync.max()) + 1 if num_blocks else 0, dtype=np.int64)
    np.maximum.at(target, block_sync, unsynced)
    want = target[block_sync]
    count = unsynced.copy()
    for b in np.flatnonzero(~done | (want > unsynced)).tolist():
        s, n = int(starts[b]), int(rows[b])
        bins = packed.get(b) or [np.flatnonzero(local[s:s + n] == m).tolist() for m in range(unsynced[b])]
        bins = _final_bins(bins, int(want[b]), sorted_tokens[s:s + n].tolist(), cap, cost)
        count[b] = len(bins)
        for m, members in enumerate(bins):
            local[s + np.asarray(members, dtype=np.int64)] = m
    micro_index = np.empty(tokens.shape[0], dtype=np.int64)
    micro_index[order] = local
    return MicroBatchPacking(micro_index, count, unsynced, lower, rows < want)
