"""The padded costs' micro-batch cuts (no remove-padding: a micro-batch computes ``rows x longest row``
positions): consecutive runs of length-sorted rows, their least padded area by a dynamic program, and the
``cost="padded"`` choice among candidate packings (see :mod:`verl_traj.core.packing.packing`). Pure module (numpy)."""

from __future__ import annotations

import math
from typing import Literal, Optional, Sequence

import numpy as np

from verl_traj.core.packing.bin_packing import Partitioner, fits, pack_into, repaired_bins

__all__ = ["Cost", "area", "bin_cost", "least_area_runs", "pack_padded", "padded_runs", "partitioner_count",
           "split_to"]

Cost = Literal["tokens", "padded", "padded_area"]


def padded_runs(sizes: list[int], cap: int) -> list[list[int]]:
    """``sizes`` sorted descending cut greedily into consecutive runs with ``len(run) * run[0] <= cap``:
    the fewest runs."""
    bins: list[list[int]] = []
    i = 0
    while i < len(sizes):
        take = max(1, cap // sizes[i])
        bins.append(list(range(i, min(i + take, len(sizes)))))
        i += take
    return bins


def least_area_runs(sizes: list[int], cap: int, k: int, bound: Literal["tokens", "area"], *,
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


def bin_cost(b: Sequence[int], sizes: list[int], cost: Cost) -> int:
    return sum(sizes[i] for i in b) if cost == "tokens" else len(b) * max(sizes[i] for i in b)


def area(bins: Sequence[Sequence[int]], sizes: list[int]) -> int:
    return sum(bin_cost(b, sizes, "padded") for b in bins)


def split_to(bins: list[list[int]], want: int, sizes: list[int], cost: Cost) -> list[list[int]]:
    """Split the costliest multi-row bin in two (rows alternate, so both halves stay under the cap
    and, for the padded costs, each half keeps rows of similar length) until ``want`` bins."""
    bins = [sorted(b) for b in bins]
    while len(bins) < want:
        splittable = [j for j, b in enumerate(bins) if len(b) > 1]
        if not splittable:
            break
        j = max(splittable, key=lambda j: (bin_cost(bins[j], sizes, cost), len(bins[j])))
        rows = bins[j]
        if cost != "tokens":  # keep runs contiguous in length order: first half / second half
            half = len(rows) // 2
            bins[j], new = rows[:half], rows[half:]
        else:
            bins[j], new = rows[0::2], rows[1::2]
        bins.append(new)
    return bins


def partitioner_count(sizes: list[int], cap: int, partitioner: Partitioner) -> int:
    """The fewest parts the partitioner (verl's own cut) needs for its token sums to fit ``cap``."""
    return next(k for k in range(max(1, -(-sum(sizes) // cap)), len(sizes) + 1)
                if fits([p for p in partitioner(sizes, k) if len(p)], sizes, cap))


def pack_padded(sizes: list[int], fewest: list[list[int]], cap: int, partitioner: Optional[Partitioner],
                 pass_cost: Optional[float]) -> list[list[int]]:
    """``cost="padded"``: from the token cost's count (``fewest``: its packing) up, the cut with the least
    ``padded area + count x pass_cost`` (``pass_cost=None``: the token cost's count only; see the module
    docstring). verl's own cut (an O(n log n) Python heap per call) is tried only when it could pad less than the
    consecutive runs found: no cut into ``k`` parts pads less than the unconstrained least-area runs at ``k``."""
    k, cost = len(fewest), pass_cost or 0.0
    k_max = k if pass_cost is None else len(sizes)
    floor = least_area_runs(sizes, math.inf, k, "area")  # the least area at k, cap ignored
    candidates = [fewest, pack_into(sizes, k, cap, fair_first=False)[0],
                  repaired_bins(sizes, k, cap, start=floor) if floor is not None else None,
                  least_area_runs(sizes, cap, k, "tokens", k_max=k_max, pass_cost=cost)]
    best = min((c for c in candidates if c is not None and fits(c, sizes, cap)),
               key=lambda c: area(c, sizes) + len(c) * cost)
    if partitioner is not None and floor is not None and (
            area(best, sizes) + len(best) * cost > area(floor, sizes) + k * cost):
        theirs = [list(p) for p in partitioner(sizes, k) if len(p)]
        if len(theirs) <= k and fits(theirs, sizes, cap) and area(theirs, sizes) < area(best, sizes) + (
                len(best) - len(theirs)) * cost:
            best = theirs
    return best
