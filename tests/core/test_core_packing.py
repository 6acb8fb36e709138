"""Micro-batch packing: the token cost reaches the exact optimum on small blocks; the padded cost runs the token
cost's count with the least padded area (never more than verl's cut of the same rows); the padded-area cost's
greedy cut is optimal; counts are synced over the ranks of a mini-batch, and every micro-batch fits the cap."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_traj.core import PackingError, min_micro_batches, pack_micro_batches


def _optimum_bins(sizes: list[int], cap: int) -> int:
    """Fewest bins of ``cap`` by trying every assignment (tiny inputs only)."""
    n = len(sizes)
    for k in range(max(1, math.ceil(sum(sizes) / cap)), n + 1):
        for assign in itertools.product(range(k), repeat=n):
            loads = [0] * k
            for s, b in zip(sizes, assign):
                loads[b] += s
            if max(loads) <= cap:
                return k
    return n


def _optimum_padded(sizes: list[int], cap: int) -> int:
    """Fewest groups with ``len * max <= cap`` over every set partition (tiny inputs only)."""
    best = len(sizes)

    def rec(i, groups):
        nonlocal best
        if len(groups) >= best:
            return
        if i == len(sizes):
            best = len(groups)
            return
        for g in groups:
            if (len(g) + 1) * max(g + [sizes[i]]) <= cap:
                g.append(sizes[i])
                rec(i + 1, groups)
                g.pop()
        groups.append([sizes[i]])
        rec(i + 1, groups)
        groups.pop()

    rec(0, [])
    return best


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=7), st.integers(0, 30))
def test_token_cost_reaches_the_optimum_on_small_blocks(sizes, extra):
    cap = max(sizes) + extra
    sizes = sorted(sizes, reverse=True)
    bins = min_micro_batches(sizes, cap)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in b) <= cap for b in bins)
    assert len(bins) == _optimum_bins(sizes, cap)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=7), st.integers(0, 60))
def test_padded_area_cost_greedy_cut_is_optimal(sizes, extra):
    cap = max(sizes) + extra
    p = pack_micro_batches(np.array(sizes), np.zeros(len(sizes), dtype=np.int64), np.zeros(1, dtype=np.int64), 1, cap,
                           cost="padded_area")
    mi = p.micro_index
    for k in np.unique(mi):
        part = np.array(sizes)[mi == k]
        assert part.size * part.max() <= cap
    assert int(p.block_count[0]) == _optimum_padded(sizes, cap)


def _load(run: list[int], bound: str) -> int:
    return len(run) * run[0] if bound == "area" else sum(run)


def _contiguous_least_area(sizes: list[int], cap: int, k: int, bound: str):
    """Least total padded area over every cut of length-sorted ``sizes`` into exactly k consecutive runs whose
    area or token sum (``bound``) fits ``cap``."""
    best = None
    for cuts in itertools.combinations(range(1, len(sizes)), k - 1):
        bounds = (0, *cuts, len(sizes))
        runs = [sizes[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        if all(_load(r, bound) <= cap for r in runs):
            area = sum(len(r) * r[0] for r in runs)
            best = area if best is None else min(best, area)
    return best


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=8), st.integers(0, 60), st.integers(1, 8),
       st.sampled_from(["area", "tokens"]))
def test_least_area_runs(sizes, extra, k, bound):
    """The dynamic program finds the least-area cut into k runs (brute force), never above the greedy
    cut's area at its count, and every run fits the cap (by area or by token sum)."""
    from verl_traj.core.packing import _least_area_runs, _padded_runs

    cap = max(sizes) + extra
    sizes = sorted(sizes, reverse=True)
    bins = _least_area_runs(sizes, cap, k, bound)
    expected = _contiguous_least_area(sizes, cap, k, bound) if k <= len(sizes) else None
    if expected is None:
        assert bins is None
        return
    assert len(bins) == k and sorted(i for b in bins for i in b) == list(range(len(sizes)))
    assert all(_load([sizes[i] for i in b], bound) <= cap for b in bins)
    assert sum(len(b) * sizes[b[0]] for b in bins) == expected
    greedy = _padded_runs(sizes, cap)
    if len(greedy) == k and bound == "area":
        assert expected <= sum(len(b) * sizes[b[0]] for b in greedy)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=24), st.integers(0, 80), st.integers(0, 2**31 - 1))
def test_padded_cost_runs_verls_count_with_no_more_padding(sizes, extra, seed):
    """``cost="padded"``: token sums fit the cap (verl's meaning of it), the count is the token cost's (so never
    above verl's cut of the same rows), and the padded area is never above verl's cut at that count."""
    from verl_traj.integration.step_plan import verl_partitioner

    cap = max(sizes) + extra
    rows = np.random.default_rng(seed).permutation(np.array(sizes))
    one = np.zeros(len(rows), dtype=np.int64), np.zeros(1, dtype=np.int64)
    p = pack_micro_batches(rows, *one, 1, cap, cost="padded", partitioner=verl_partitioner)
    tok = pack_micro_batches(rows, *one, 1, cap, cost="tokens", partitioner=verl_partitioner)
    assert p.block_count[0] == tok.block_count[0]
    parts = [rows[p.micro_index == m] for m in range(int(p.block_count[0]))]
    assert all(part.size and part.sum() <= cap for part in parts)
    ordered = sorted(sizes, reverse=True)
    theirs = [list(b) for b in verl_partitioner(ordered, int(p.block_count[0])) if len(b)]
    if all(sum(ordered[i] for i in b) <= cap for b in theirs):
        assert sum(part.size * part.max() for part in parts) <= sum(len(b) * max(ordered[i] for i in b) for b in theirs)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=8), st.integers(0, 60), st.integers(0, 120))
def test_padded_cost_trades_passes_for_padding_at_the_pass_cost(sizes, extra, pass_cost):
    """With a pass cost, ``cost="padded"`` takes at least the token cost's count and the least ``padded area +
    count x pass_cost`` over every cut of the length-sorted rows into consecutive token-fitting runs (brute
    force over all counts), never worse than the token cost's own packing."""
    cap = max(sizes) + extra
    ordered = sorted(sizes, reverse=True)
    one = np.zeros(len(sizes), dtype=np.int64), np.zeros(1, dtype=np.int64)
    p = pack_micro_batches(np.array(sizes), *one, 1, cap, cost="padded", pass_cost=pass_cost)
    k = int(p.block_count[0])
    parts = [np.array(sizes)[p.micro_index == m] for m in range(k)]
    assert all(part.size and part.sum() <= cap for part in parts)
    objective = sum(part.size * part.max() for part in parts) + k * pass_cost
    fewest = min_micro_batches(ordered, cap)
    assert k >= len(fewest)
    assert objective <= sum(len(b) * max(ordered[i] for i in b) for b in fewest) + len(fewest) * pass_cost
    brute = [_contiguous_least_area(ordered, cap, j, "tokens") for j in range(len(fewest), len(sizes) + 1)]
    assert objective <= min(a + j * pass_cost for j, a in zip(range(len(fewest), len(sizes) + 1), brute)
                            if a is not None)


def test_padded_area_cost_takes_the_partitioners_count_when_larger():
    """With verl's own cut as the partitioner, the padded packing uses as many micro-batches as verl would
    (when more than the fewest that fit) and spends them on less padding."""
    sizes = np.array([100, 90, 40, 35, 30, 10, 8, 5])

    def one_row_each(sizes_, k):  # a partitioner that only ever fits with one row per part
        return [[i] for i in range(len(sizes_))] if k >= len(sizes_) else [list(range(len(sizes_)))]

    block, sync = np.zeros(8, dtype=np.int64), np.zeros(1, dtype=np.int64)
    fewest = pack_micro_batches(sizes, block, sync, 1, 200, cost="padded_area")
    many = pack_micro_batches(sizes, block, sync, 1, 200, cost="padded_area", partitioner=one_row_each)
    assert fewest.block_count[0] < many.block_count[0] == 8  # one row each: no padded position at all


@pytest.mark.parametrize("cost", ["padded", "padded_area"])
def test_padded_costs_group_rows_of_similar_length(cost):
    # 4 long rows and 4 short ones: the long rows share micro-batches, the short ones theirs
    sizes = np.array([100, 5, 100, 5, 100, 5, 100, 5])
    p = pack_micro_batches(sizes, np.zeros(8, dtype=np.int64), np.zeros(1, dtype=np.int64), 1, 200, cost=cost)
    for k in np.unique(p.micro_index):
        assert len(set(sizes[p.micro_index == k].tolist())) == 1


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 4), st.integers(1, 5),
       st.sampled_from(["tokens", "padded", "padded_area"]))
def test_counts_are_synced_per_mini_batch(seed, dp, rows_per_rank, cost):
    rng = np.random.default_rng(seed)
    n = dp * rows_per_rank
    tokens = rng.integers(1, 50, size=n)
    block = np.repeat(np.arange(dp), rows_per_rank)  # one mini-batch
    cap = int(tokens.max()) + int(rng.integers(0, 60))
    p = pack_micro_batches(tokens, block, np.zeros(dp, dtype=np.int64), dp, cap, cost=cost)
    counts = [len(np.unique(p.micro_index[block == r])) for r in range(dp)]
    assert len(set(counts)) == 1 and counts[0] == p.block_count.max()
    assert not p.ranks_short_of_rows.any()
    for r in range(dp):
        for k in np.unique(p.micro_index[block == r]):
            part = tokens[(block == r) & (p.micro_index == k)]
            assert (part.size * part.max() if cost == "padded_area" else part.sum()) <= cap


def test_extra_partitioner_is_a_candidate():
    # BFD needs 4 bins and LPT does not fit 3; the caller's partitioner knows a 3-bin packing
    sizes, cap = [8, 6, 5, 5, 4, 3, 3, 2], 12
    calls = []

    def known(sizes_, k):
        calls.append(k)
        return [[0, 4], [1, 5, 6], [2, 3, 7]]

    bins = min_micro_batches(sizes, cap, partitioner=known)
    assert calls == [3] and sorted(map(sorted, bins)) == [[0, 4], [1, 5, 6], [2, 3, 7]]
    assert len(min_micro_batches(sizes, cap)) == 3  # the exact search finds it too


def test_row_above_cap_is_refused():
    with pytest.raises(PackingError, match="below the longest row"):
        pack_micro_batches(np.array([5, 12]), np.zeros(2, dtype=np.int64), np.zeros(1, dtype=np.int64), 1, 10)
