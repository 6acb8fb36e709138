"""Token-capped micro-batch packing per (mini-batch, rank) block.

``micro_batch_max_tokens`` is a hard cap on the attended (prompt + response) tokens of one
micro-batch on one rank, independent of the maximum sequence length. Packing never changes what a
mini-batch contains (one mini-batch = one optimizer step); it only decides how a rank's rows of a
mini-batch are cut into forward/backward passes.

Algorithm: best-fit decreasing per block (rows by tokens descending, each into the open micro-batch
with the least room that still fits, else a new one; ``bisect`` over the sorted free capacities).
Then, as verl syncs the micro-batch COUNT over DP ranks (``rearrange_micro_batches`` takes the max),
every rank of a mini-batch is brought to the same count by splitting its micro-batch with the most
rows in two (halves alternate over the rows sorted by tokens, so both halves stay under the cap).
A rank with fewer rows than the synced count cannot be split that far; it keeps one row per
micro-batch and is counted in ``ranks_short_of_rows`` (verl 0.9.1 raises in that case: "Requested N
non-empty micro-batches, but a rank has only M forced groups") -- a warning metric for the trainer.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

__all__ = ["PackingError", "MicroBatchPacking", "pack_micro_batches"]


class PackingError(ValueError):
    """The token cap cannot be met (a single row is longer than the cap)."""


@dataclass(frozen=True)
class MicroBatchPacking:
    """Result of :func:`pack_micro_batches`.

    micro_index: ``[N]`` int64 micro-batch of each row within its block (0..count-1).
    block_count: ``[num_blocks]`` int64 micro-batches of each block (after the DP sync).
    block_count_unsynced: ``[num_blocks]`` int64 micro-batches best-fit-decreasing needed per block.
    ranks_short_of_rows: ``[num_blocks]`` bool, block has fewer rows than its mini-batch's synced count.
    """

    micro_index: np.ndarray
    block_count: np.ndarray
    block_count_unsynced: np.ndarray
    ranks_short_of_rows: np.ndarray


def _best_fit_decreasing(tokens: list[int], cap: int) -> tuple[list[int], list[list[int]]]:
    """Pack ``tokens`` (already sorted descending) -> (bin of each item, items of each bin).

    Free capacities are kept sorted as ints ``room * K + bin`` (K > #bins), so ``bisect`` finds the
    tightest bin that still fits in O(log bins) comparisons of plain ints.
    """
    K = len(tokens) + 1
    free: list[int] = []
    members: list[list[int]] = []
    assign = [0] * len(tokens)
    bisect_left, insort, pop = bisect.bisect_left, bisect.insort, free.pop
    for i, t in enumerate(tokens):
        k = bisect_left(free, t * K)
        if k < len(free):
            key = pop(k)
            b = key % K
            insort(free, key - t * K)
        else:
            b = len(members)
            members.append([])
            insort(free, (cap - t) * K + b)
        members[b].append(i)
        assign[i] = b
    return assign, members


def pack_micro_batches(
    tokens: np.ndarray,
    block: np.ndarray,
    block_sync: np.ndarray,
    num_blocks: int,
    cap: int,
) -> MicroBatchPacking:
    """Pack every block's rows into micro-batches of at most ``cap`` tokens with synced counts.

    Args:
        tokens: ``[N]`` int attended tokens per row (padding rows included: they are real forward rows).
        block: ``[N]`` int block of each row (block = mini_batch * dp + rank).
        block_sync: ``[num_blocks]`` int sync set of each block (= its mini-batch): all blocks of one
            sync set end with the same micro-batch count (where they have enough rows).
        cap: tokens per micro-batch, ``>= tokens.max()``.
    Raises:
        PackingError: a row is longer than ``cap``.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    n = tokens.shape[0]
    if n and int(tokens.max()) > cap:
        raise PackingError(
            f"micro_batch_max_tokens={cap} is below the longest row ({int(tokens.max())} tokens). "
            "Fix: raise micro_batch_max_tokens to at least the max prompt+response length "
            "(a row cannot be split across micro-batches)."
        )
    order = np.lexsort((-tokens, block))
    sizes = np.bincount(block, minlength=num_blocks)
    starts = np.cumsum(sizes) - sizes
    micro_index = np.zeros(n, dtype=np.int64)
    unsynced = np.zeros(num_blocks, dtype=np.int64)
    members_of: list[list[list[int]]] = []
    assign_of: list[np.ndarray] = []
    tok_sorted = tokens[order].tolist()
    for b in range(num_blocks):
        s, e = int(starts[b]), int(starts[b] + sizes[b])
        if e == s:
            members_of.append([])
            assign_of.append(np.zeros(0, dtype=np.int64))
            continue
        assign, members = _best_fit_decreasing(tok_sorted[s:e], cap)
        members_of.append(members)
        assign_of.append(np.asarray(assign, dtype=np.int64))
        unsynced[b] = len(members)
    target = np.zeros(int(block_sync.max()) + 1 if num_blocks else 0, dtype=np.int64)
    np.maximum.at(target, block_sync, unsynced)
    count = unsynced.copy()
    short = np.zeros(num_blocks, dtype=bool)
    for b in range(num_blocks):
        want = int(target[block_sync[b]])
        members = members_of[b]
        if len(members) < want:
            if sizes[b] < want:
                short[b] = True
                want = int(sizes[b])
            while len(members) < want:
                # split the micro-batch with most rows (ties: most tokens); members hold indices sorted by tokens desc
                k = max(range(len(members)), key=lambda m: (len(members[m]), sum(tok_sorted[starts[b] + i] for i in members[m])))
                rows = sorted(members[k])
                members[k] = rows[0::2]
                members.append(rows[1::2])
            count[b] = len(members)
            for m, rows in enumerate(members):
                assign_of[b][rows] = m
        s = int(starts[b])
        micro_index[order[s : s + int(sizes[b])]] = assign_of[b]
    return MicroBatchPacking(micro_index, count, unsynced, short)
