"""Prefix-tree plans (issue 29, item 4): rows that share prefixes forwarded as one tree, costs in tree tokens.

With ``PlanSpec.prefix_tree`` the planner places *pieces*, not rows, on ranks and micro-batches:

* a unit (a GRPO group with ``group_by="group"``, else a trajectory) is one piece when its tree fits the micro-batch
  cap; a larger one is cut depth-first (its distinct rows in lexicographic order, consecutive runs) into pieces whose
  trees fit, each re-paying the ancestor path it shares with the piece before (:func:`unit_pieces`). A unit's cost
  when the planner assigns it to a mini-batch is its whole tree (the distinct prefixes of its rows);
* with the device's cost model (``PlanSpec.tree_cost``) a piece whose tree does not pay against its rows is cut into
  its rows, each a piece of its own tokens (:func:`rows_where_trees_do_not_pay`): their micro-batches fit the cap as
  rows, and the decision per micro-batch runs them as rows;
* a mini-batch's pieces go to ranks by LPT on tree tokens, then each rank's pieces into the fewest micro-batches whose
  tree tokens fit the cap (:func:`~verl_traj.core.packing.packing.min_micro_batches`). Every rank of a mini-batch runs the
  same number of micro-batches (FSDP's collectives run per pass): a rank short of pieces splits a micro-batch of
  several pieces, and where none is left gets a micro-batch of one padding row;
* padding rows then give every rank of a mini-batch the same number of rows (verl's dispatch splits evenly); they go
  to the rank's cheapest micro-batch, where identical padding rows share their two tree tokens.

A piece's cost is its own tree's tokens: an upper bound on what it adds to a micro-batch's tree (pieces of different
units may share a system prompt too, a bonus the plan does not count). The rows of a piece always share one rank and
one micro-batch, so a unit is atomic wherever its tree fits the cap. Pure module (numpy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from verl_traj.core.packing.balancing import lpt
from verl_traj.core.errors import TrajInputError
from verl_traj.core.packing.bin_packing import fewest_bins
from verl_traj.core.packing.packing import PackingError
from verl_traj.core.trees.token_rows import token_rows
from verl_traj.core.trees.trie_layout import trie_layout

__all__ = ["TreePieces", "TreePlacement", "place_pieces", "unit_pieces"]


@dataclass(frozen=True)
class TreePieces:
    """``R`` rows cut into ``P`` pieces of ``U`` units: ``of_row`` ``[R]`` piece of each row, ``unit`` ``[P]`` unit
    of each piece (pieces of a unit are consecutive), ``tokens`` ``[P]`` tree tokens of each piece (its own tree,
    ancestor path included), ``unit_tokens`` ``[U]`` tree tokens of each whole unit (<= the sum of its pieces)."""

    of_row: np.ndarray
    unit: np.ndarray
    tokens: np.ndarray
    unit_tokens: np.ndarray


def _cut(unit: np.ndarray, lengths: np.ndarray, added: np.ndarray, unit_tokens: np.ndarray,
         cap: Optional[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pieces of the units whose trees exceed ``cap``: consecutive runs of their sorted distinct rows (``unit`` /
    ``lengths`` / ``added`` ``[D]``, units ascending, ``added >= 1``) whose trees fit, a run's tree its first row whole
    plus what each later row adds, each run as long as it fits (greedy). Returns ``(piece within its unit of each
    distinct row [D], pieces per unit [U], tree tokens of each piece of the cut units, units then pieces in order)``;
    a unit that fits is one piece. One round per piece of the most cut unit, every cut unit at once: a run from row
    ``s`` ends at the last ``e`` with ``sum(added[s+1..e]) <= cap - lengths[s]`` (a search in the cumulative sum)."""
    local = np.zeros(unit.size, dtype=np.int64)
    count = np.ones(unit_tokens.size, dtype=np.int64)
    big = np.flatnonzero(unit_tokens > cap) if cap is not None else np.zeros(0, dtype=np.int64)
    total = np.cumsum(added)
    start, last = np.searchsorted(unit, big), np.searchsorted(unit, big, side="right") - 1
    begins = np.zeros(unit.size, dtype=np.int64)
    costs, piece_unit, piece_round = [], [], []
    live, round_ = np.arange(big.size), 0
    while live.size:
        s = start[live]
        e = np.minimum(np.searchsorted(total, cap - lengths[s] + total[s], side="right") - 1, last[live])
        begins[s] = 1
        costs.append(lengths[s] + total[e] - total[s])
        piece_unit.append(big[live])
        piece_round.append(np.full(live.size, round_))
        start[live] = e + 1
        live, round_ = live[e < last[live]], round_ + 1
    member = np.isin(unit, big)
    runs = np.cumsum(begins)  # piece starts up to each row; a cut unit's first row starts its first piece
    local[member] = runs[member] - runs[np.searchsorted(unit, unit[member])]
    units, rounds = (np.concatenate(x) if x else np.zeros(0, np.int64) for x in (piece_unit, piece_round))
    count[big] = np.bincount(units, minlength=unit_tokens.size)[big]
    order = np.lexsort((rounds, units))
    return local, count, (np.concatenate(costs)[order] if costs else np.zeros(0, np.int64))


def unit_pieces(rows: Any, unit: np.ndarray, num_units: int, cap: Optional[int]) -> TreePieces:
    """Cut each unit's rows into pieces whose prefix trees fit ``cap`` tokens (module docstring).

    Args:
        rows: ``R`` rows' attended token ids (as :func:`~verl_traj.core.trees.prefix_tree.build_prefix_tree` takes them, or
            :class:`~verl_traj.core.trees.token_rows.TokenRows`).
        unit: ``[R]`` int unit of each row, in ``0..num_units-1``; every unit has a row.
        cap: tree tokens per micro-batch, or None (one piece per unit).
    Raises :class:`PackingError` (field ``micro_batch_max_tokens``) when a row alone is longer than ``cap``.
    Cost: every unit's tree at once (:mod:`~verl_traj.core.trees.trie_layout`); a Python loop over the rows of the units
    whose trees exceed ``cap`` only.
    """
    rows = token_rows(rows)
    unit = np.asarray(unit, dtype=np.int64)
    if unit.shape != (rows.num_rows,) or (unit.size and (unit.min() < 0 or unit.max() >= num_units)):
        raise TrajInputError.invalid("unit", unit, f"is not [R={rows.num_rows}] ints in 0..{num_units - 1}",
                                     "pass each row's dense unit index")
    longest = int(rows.lengths.max(initial=0))
    if cap is not None and longest > cap:
        raise PackingError(f"micro_batch_max_tokens={cap} is below the longest row ({longest} tokens). Fix: raise the "
                           "micro-batch token cap to at least the max prompt+response length (a row cannot be split "
                           "across micro-batches).", field="micro_batch_max_tokens")
    layout = trie_layout(rows, unit)
    d_unit = unit[layout.distinct]
    unit_tokens = np.bincount(d_unit, weights=layout.sizes, minlength=num_units).astype(np.int64)
    local, count, costs = _cut(d_unit, layout.lengths, layout.sizes, unit_tokens, cap)
    piece_unit = np.repeat(np.arange(num_units, dtype=np.int64), count)
    tokens = np.repeat(unit_tokens, count)
    if cap is not None:
        tokens[unit_tokens[piece_unit] > cap] = costs
    first = np.cumsum(count) - count
    of_row = first[unit] + np.where(layout.of_row >= 0, local[layout.of_row.clip(min=0)], 0)
    return TreePieces(of_row, piece_unit, tokens, unit_tokens)


@dataclass(frozen=True)
class TreePlacement:
    """Where the pieces and the padding rows go. ``rank`` / ``micro`` ``[P]``: each piece's DP rank and micro-batch
    within its (mini-batch, rank); ``pad_mb`` / ``pad_rank`` / ``pad_micro`` ``[Q]``: the padding rows';
    ``count`` ``[M]`` micro-batches per rank of each mini-batch; ``lower_bound`` ``[M]`` max over ranks of
    ``ceil(rank tree tokens / cap)``; ``max_packed`` ``[M]`` tree tokens of the largest micro-batch (pieces' sums)."""

    rank: np.ndarray
    micro: np.ndarray
    pad_mb: np.ndarray
    pad_rank: np.ndarray
    pad_micro: np.ndarray
    count: np.ndarray
    lower_bound: np.ndarray
    max_packed: np.ndarray


def _bins(sizes: list[int], cap: Optional[int]) -> tuple[list[list[int]], int]:
    """Fewest micro-batches of one rank's pieces (``sizes`` descending) under ``cap`` (all in one without a cap),
    and the fewest that any packing of them needs (:func:`~verl_traj.core.packing.bin_packing.fewest_bins`' bound)."""
    if not sizes:
        return [], 0
    if cap is None:
        return [list(range(len(sizes)))], 1
    packing = fewest_bins(sizes, cap)
    return packing.bins, packing.lower_bound


def _split_to(bins: list[list[int]], want: int, sizes: list[int]) -> list[list[int]]:
    """Split the costliest micro-batch of several pieces in two (alternating, largest first) until ``want``
    micro-batches or none has two pieces left; halves of a micro-batch under the cap stay under it."""
    bins = [list(b) for b in bins]
    while len(bins) < want:
        several = [i for i, b in enumerate(bins) if len(b) > 1]
        if not several:
            break
        i = max(several, key=lambda j: sum(sizes[p] for p in bins[j]))
        ranked = sorted(bins[i], key=lambda p: -sizes[p])
        bins[i], extra = ranked[0::2], ranked[1::2]
        bins.append(extra)
    return bins


def _place_mini_batch(tokens: np.ndarray, rows: np.ndarray, dp: int, cap: Optional[int], pad_tokens: int,
                      balance_dp: bool, rng: np.random.Generator):
    """One mini-batch's pieces (``tokens`` / ``rows`` ``[p]``): ``(rank [p], micro [p], padding (rank, micro) pairs,
    count, lower bound, largest micro-batch)``."""
    p = tokens.size
    if balance_dp:
        perm = rng.permutation(p)
        rank = lpt(tokens, dp, order=perm[np.argsort(-tokens[perm], kind="stable")])
    else:
        rank = np.arange(p, dtype=np.int64) % dp
    per_rank, lower = [], 1
    for r in range(dp):
        idx = np.flatnonzero(rank == r)
        idx = idx[np.argsort(-tokens[idx], kind="stable")]
        bins, bound = _bins(tokens[idx].tolist(), cap)
        per_rank.append((idx, bins))
        lower = max(lower, bound)
    count = max(1, max(len(b) for _, b in per_rank))
    while True:  # one more micro-batch on every rank only where a padding row fits in none of a rank's
        micro, pads, loads = _fill(tokens, rows, per_rank, count, cap, pad_tokens)
        if pads is not None:
            break
        count += 1
    return rank, micro, pads, count, lower, max(max(lo) for lo in loads)


def _fill(tokens: np.ndarray, rows: np.ndarray, per_rank: list, count: int, cap: Optional[int], pad_tokens: int):
    """Each rank's micro-batches brought to ``count`` and its rows to the mini-batch's most, with padding rows: one
    in each micro-batch a rank has no piece for, the rest in the first of those or else its cheapest. Returns
    ``(micro [p], padding (rank, micro) pairs, loads per rank)``; padding ``None`` where a padding row would push a
    micro-batch over ``cap``."""
    micro = np.zeros(tokens.size, dtype=np.int64)
    empty: list[list[int]] = []
    loads: list[list[int]] = []
    for idx, bins in per_rank:
        bins = _split_to(bins, count, tokens[idx].tolist())
        for m, b in enumerate(bins):
            micro[idx[b]] = m
        loads.append([int(tokens[idx[b]].sum()) for b in bins] + [pad_tokens] * (count - len(bins)))
        empty.append(list(range(len(bins), count)))
    have = [int(rows[idx].sum()) + len(e) for (idx, _), e in zip(per_rank, empty)]
    target = max(have)
    pads: list[tuple[int, int]] = []
    for r, e in enumerate(empty):
        pads += [(r, m) for m in e]
        if target > have[r]:
            cheapest = e[0] if e else int(np.argmin(loads[r]))
            if cap is not None and not e and loads[r][cheapest] + pad_tokens > cap:
                return micro, None, loads
            pads += [(r, cheapest)] * (target - have[r])
    return micro, pads, loads


def place_pieces(tokens: np.ndarray, mini_batch: np.ndarray, rows: np.ndarray, num_mini_batches: int, dp: int,
                 cap: Optional[int], balance_dp: bool, rng: np.random.Generator, pad_tokens: int = 2) -> TreePlacement:
    """Ranks, micro-batches and padding rows of ``P`` pieces (module docstring).

    Args:
        tokens / mini_batch / rows: ``[P]`` tree tokens, mini-batch and row count of each piece (every piece has a
            row, every mini-batch a piece); ``pad_tokens``: a padding row's tokens (identical padding rows in one
            micro-batch share them in its tree).
    Invariants of the result: per mini-batch every rank holds the same number of rows (pieces' rows + padding) and
    runs ``count[m]`` micro-batches, each holding a row; a micro-batch's pieces, plus ``pad_tokens`` where it holds
    padding rows, sum to at most ``cap`` tree tokens.
    """
    out = {k: np.zeros(tokens.size, dtype=np.int64) for k in ("rank", "micro")}
    pads: list[tuple[int, int, int]] = []
    stats = np.zeros((3, num_mini_batches), dtype=np.int64)
    for m in range(num_mini_batches):
        idx = np.flatnonzero(mini_batch == m)
        rank, micro, mb_pads, count, lower, packed = _place_mini_batch(tokens[idx], rows[idx], dp, cap, pad_tokens,
                                                                      balance_dp, rng)
        out["rank"][idx], out["micro"][idx] = rank, micro
        pads += [(m, r, mi) for r, mi in mb_pads]
        stats[:, m] = (count, lower, packed)
    pad = np.asarray(pads, dtype=np.int64).reshape(-1, 3)
    return TreePlacement(out["rank"], out["micro"], pad[:, 0], pad[:, 1], pad[:, 2], *stats)


def real_units(layout: Any, group_by: str) -> tuple[np.ndarray, np.ndarray, int]:
    """``(real rows [n], unit of each [n], number of units)`` of a :class:`~verl_traj.core.plan.layout.BatchLayout`: a
    unit is a group (``group_by="group"``) or a trajectory."""
    real = np.flatnonzero(~layout.is_padding.numpy())
    if group_by == "group":
        return real, layout.group_index.numpy()[real], layout.num_groups
    return real, layout.traj_index.numpy()[real], layout.num_trajectories


def tree_pieces(layout: Any, spec: Any, rows: Any) -> TreePieces:
    """The pieces of a layout's real rows (``rows``: every row's attended token ids, padding rows included, each as
    long as the layout counts its tokens) under ``spec.micro_batch_max_tokens``."""
    if rows is None:
        raise TrajInputError.invalid("rows", rows, "is missing: a prefix-tree plan costs units in tree tokens",
                                     "pass rows=[each row's attended token ids] with prefix_tree=True")
    rows = token_rows(rows)
    counts = layout.num_tokens.numpy()
    if rows.lengths.shape != counts.shape or not np.array_equal(rows.lengths, counts):
        same = rows.lengths.shape == counts.shape
        bad = int(np.flatnonzero(rows.lengths != counts)[0]) if same else rows.num_rows
        raise TrajInputError.invalid(f"rows[{bad}]" if same else "rows", f"{rows.num_rows} rows",
                                     f"do not match the layout's {counts.size} rows of num_tokens tokens",
                                     "pass the attended token ids of the rows the layout was built from, in its order")
    real, unit, num_units = real_units(layout, spec.group_by)
    real_rows = rows if real.size == rows.num_rows else rows.take(real)
    pieces = unit_pieces(real_rows, unit, num_units, spec.micro_batch_max_tokens)
    return pieces if spec.tree_cost is None else rows_where_trees_do_not_pay(pieces, real_rows.lengths, spec.tree_cost)


def rows_where_trees_do_not_pay(pieces: TreePieces, lengths: np.ndarray, cost: Any) -> TreePieces:
    """``pieces`` with every piece whose tree does not pay against its rows (``cost``, a
    :class:`~verl_traj.core.trees.tree_cost.TreeCostModel`; ``lengths`` ``[R]`` each row's attended tokens) cut into
    one piece per row, costing its tokens: placement then packs those rows as the rows path would, so their
    micro-batches fit the cap as rows and the per-micro-batch decision
    (:func:`~verl_traj.integration.trainers.tree_plan_facts.tree_choice`) can run them as rows. Pieces stay in unit
    order, a cut piece's rows in row order; a paying piece is kept whole (atomic, its tree tokens)."""
    row_tokens = np.bincount(pieces.of_row, weights=lengths, minlength=pieces.tokens.size)
    cut = ~cost.pays(pieces.tokens, row_tokens)
    if not cut.any():
        return pieces
    alone = np.where(cut[pieces.of_row], np.arange(pieces.of_row.size), -1)  # a cut piece's row: its own piece
    kept, of_row = np.unique(np.stack([pieces.of_row, alone], axis=1), axis=0, return_inverse=True)
    tokens = np.where(kept[:, 1] >= 0, lengths[kept[:, 1].clip(min=0)], pieces.tokens[kept[:, 0]]).astype(np.int64)
    return TreePieces(of_row.reshape(-1), pieces.unit[kept[:, 0]], tokens, pieces.unit_tokens)


def place_tree_pieces(pieces: TreePieces, row_mini_batch: np.ndarray, spec: Any,
                      rng: np.random.Generator) -> TreePlacement:
    """:func:`place_pieces` for the real rows' pieces, each row's mini-batch ``row_mini_batch`` ``[n]``."""
    num = pieces.tokens.size
    mini_batch = np.zeros(num, dtype=np.int64)
    mini_batch[pieces.of_row] = row_mini_batch
    rows = np.bincount(pieces.of_row, minlength=num)
    return place_pieces(pieces.tokens, mini_batch, rows, int(spec.num_mini_batches), int(spec.dp_size),
                        spec.micro_batch_max_tokens, bool(spec.balance_dp), rng, int(spec.pad_row_tokens))


def tree_micro_stats(items: Any, pieces: TreePieces, placement: TreePlacement,
                     spec: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """``(micro-batch of every item [N], the plan's micro-batch statistics)`` of a placed tree plan; ``items``: the
    real rows (in the order of ``pieces.of_row``), then the padding rows (in the placement's order)."""
    m = int(spec.num_mini_batches)
    micro = np.concatenate([placement.micro[pieces.of_row], placement.pad_micro])
    real = ~items.pad
    mini_batch = np.zeros(pieces.tokens.size, dtype=np.int64)
    mini_batch[pieces.of_row] = items.mb[real]
    where = (items.rank * (int(micro.max(initial=0)) + 1) + micro)[real]
    pairs = np.unique(np.stack([items.traj[real], where], axis=1), axis=0)
    places = np.bincount(pairs[:, 0], minlength=int(items.traj.max(initial=-1)) + 1)
    traj_mb = np.zeros(places.size, dtype=np.int64)
    traj_mb[items.traj[real]] = items.mb[real]
    zeros = np.zeros(m, dtype=np.int64)
    return micro, {
        "micro_batches": placement.count, "micro_batches_lower_bound": placement.lower_bound,
        "max_packed_tokens": placement.max_packed, "padded_positions": zeros, "ranks_short_of_rows": zeros,
        "tree_tokens": np.bincount(mini_batch, weights=pieces.tokens, minlength=m).astype(np.int64),
        "atomic_trajectories": np.bincount(traj_mb[places == 1], minlength=m).astype(np.int64),
    }
