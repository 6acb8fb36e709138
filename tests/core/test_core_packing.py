"""Micro-batch packing: the token cost reaches the exact optimum on small blocks (brute force), its lower bound is
valid and equals the optimum there, and tight blocks of agent rows reach the bound; the padded cost runs the token
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
from verl_traj.core.packing.bin_packing import bin_lower_bound, fewest_bins, pack_into, repaired_bins

from tests.core.plan_checks import fewest_bins_brute


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
    assert len(bins) == fewest_bins_brute(sizes, cap) == fewest_bins(sizes, cap).lower_bound


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=7), st.integers(0, 30), st.integers(1, 4))
def test_exact_search_settles_small_blocks(sizes, extra, k):
    """``pack_into`` finds a packing into k bins exactly when one exists (brute force), in either completion
    order; with no budget it settles only what needs no search."""
    cap = max(max(sizes), 1) + extra
    sizes = sorted(sizes, reverse=True)
    feasible = (not sizes or fewest_bins_brute(sizes, cap) <= k)
    for fair_first in (True, False):
        bins, settled = pack_into(sizes, k, cap, fair_first=fair_first)
        assert settled and (bins is not None) == feasible
        if bins is not None:
            assert len(bins) <= k and sorted(i for b in bins for i in b) == list(range(len(sizes)))
            assert all(sum(sizes[i] for i in b) <= cap for b in bins)
    bins, settled = pack_into(sizes, k, cap, budget=0)
    assert bins is None and (not settled or not feasible)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=7), st.integers(0, 30))
def test_lower_bound_is_valid_and_counts_rows_over_half_the_cap(sizes, extra):
    """Martello-Toth's L2: never above the optimum (brute force), never below ceil(sum / cap) nor the rows longer
    than half the cap (no two of them share a micro-batch)."""
    cap = max(max(sizes), 1) + extra
    bound = bin_lower_bound(sizes, cap)
    assert max(math.ceil(sum(sizes) / cap), sum(2 * s > cap for s in sizes), 1) <= bound
    assert bound <= fewest_bins_brute(sorted(sizes, reverse=True), cap)


def test_reported_bound_counts_rows_over_half_the_cap():
    # three rows of 6 under a cap of 10: ceil(18 / 10) = 2, but no two rows share a micro-batch
    one = np.zeros(3, dtype=np.int64), np.zeros(1, dtype=np.int64)
    p = pack_micro_batches(np.array([6, 6, 6]), *one, 1, 10)
    assert p.block_count[0] == p.block_lower_bound[0] == 3


# 22 calculator-agent rows (prompt ~160 + a merged multi-turn response) of one rank and mini-batch under the quick
# start's cap: 5,723 tokens fit 3 micro-batches of 2,048 with 421 to spare. LPT and best-fit need 4, and so did the
# former item-by-item search (out of budget).
TIGHT_ROWS = [419, 415, 377, 349, 336, 320, 304, 293, 290, 273, 257, 253, 252, 243, 236, 235, 233, 229, 220, 207, 200,
              192]
# 24 such rows where the padded cost (no remove-padding, pass cost 1,024 positions) took 4 passes: at 3 its only
# token-fitting candidate was an arbitrary packing that padded more than a pass costs.
TIGHT_PADDED_ROWS = [419, 362, 345, 304, 300, 291, 261, 258, 249, 244, 240, 238, 236, 228, 227, 225, 222, 216, 215,
                     209, 202, 183, 176, 176]
# 14 rows that fit 2 passes only with much padding unless the exact search keeps rows of similar length together
SIMILAR_PADDED_ROWS = [419, 417, 377, 361, 305, 301, 289, 261, 244, 243, 240, 235, 195, 188]


# The quick start's step 11 (seed 0), mini-batch 0: 8,150 tokens in 4 micro-batches of 2,048 (42 to spare); many
# rows of nearly one length make the depth-first search run out of budget, the local search finds it.
QUICKSTART_STEP11_MB0 = [415, 289, 289, 288, 288, 287, 286, 285, 249, 249, 249, 248, 247, 245, 245, 245, 245, 245, 245,
                         245, 244, 244, 244, 244, 243, 243, 236, 227, 225, 224, 205, 187]
# Its mini-batch 1, padded cost: 4 passes beat 5 only with the least-area runs repaired to fit the cap.
QUICKSTART_STEP11_MB1 = [317, 289, 289, 287, 287, 287, 287, 287, 287, 287, 285, 273, 264, 249, 248, 248, 247, 247, 247,
                         244, 243, 243, 243, 243, 242, 234, 226, 219, 212, 194, 190, 185]


@pytest.mark.parametrize("cost, rows", [("tokens", TIGHT_ROWS), ("padded", TIGHT_PADDED_ROWS),
                                        ("padded", SIMILAR_PADDED_ROWS), ("tokens", QUICKSTART_STEP11_MB0),
                                        ("padded", QUICKSTART_STEP11_MB1)])
def test_tight_blocks_of_agent_rows_reach_the_bound(cost, rows):
    from verl_traj.integration.trainers.step_plan import verl_partitioner

    tokens = np.random.default_rng(0).permutation(np.array(rows))
    one = np.zeros(len(rows), dtype=np.int64), np.zeros(1, dtype=np.int64)
    p = pack_micro_batches(tokens, *one, 1, 2048, cost=cost, partitioner=verl_partitioner,
                           pass_cost=1024 if cost == "padded" else None)
    k = math.ceil(tokens.sum() / 2048)
    assert p.block_count[0] == p.block_lower_bound[0] == k
    parts = [tokens[p.micro_index == m] for m in range(k)]
    assert all(part.size and part.sum() <= 2048 for part in parts)
    if cost == "padded":  # the bound is taken because it costs less than any cut into more passes
        from verl_traj.core.packing.padded_packing import least_area_runs as _least_area_runs

        ordered = sorted(rows, reverse=True)
        objective = sum(part.size * part.max() for part in parts) + k * 1024
        more = _least_area_runs(ordered, 2048, k + 1, "tokens", k_max=len(rows), pass_cost=1024)
        assert objective < sum(len(b) * ordered[b[0]] for b in more) + len(more) * 1024


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 3), st.integers(1, 5), st.integers(0, 40))
def test_synced_count_is_the_optimum_of_the_constrained_problem(seed, dp, rows_per_rank, extra):
    """One mini-batch of ``dp`` ranks, rows fixed per rank: every rank runs the same number of micro-batches, each
    row once, every micro-batch within the cap, and that count is the fewest possible (the max over ranks of each
    rank's optimum, brute force), which is also the reported bound."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 40, size=dp * rows_per_rank)
    block = np.repeat(np.arange(dp), rows_per_rank)
    cap = int(tokens.max()) + extra
    p = pack_micro_batches(tokens, block, np.zeros(dp, dtype=np.int64), dp, cap)
    optimum = [fewest_bins_brute(sorted(tokens[block == r].tolist(), reverse=True), cap) for r in range(dp)]
    assert p.block_lower_bound.tolist() == optimum == p.block_count_unsynced.tolist()
    assert p.block_count.tolist() == [max(optimum)] * dp
    for r in range(dp):
        mine = p.micro_index[block == r]
        assert sorted(set(mine.tolist())) == list(range(max(optimum)))  # every micro-batch holds a row
        assert all(tokens[block == r][mine == m].sum() <= cap for m in range(max(optimum)))


def test_local_search_packs_what_the_search_cannot_reach():
    assert pack_into(QUICKSTART_STEP11_MB0, 4, 2048) == (None, False)  # out of budget
    bins = repaired_bins(QUICKSTART_STEP11_MB0, 4, 2048)
    assert len(bins) == 4 and all(sum(QUICKSTART_STEP11_MB0[i] for i in b) <= 2048 for b in bins)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=30), st.integers(0, 40), st.integers(1, 6))
def test_local_search_keeps_every_row_and_never_overflows_more_than_lpt(sizes, extra, k):
    cap = max(sizes) + extra
    sizes = sorted(sizes, reverse=True)

    def overflow(bins):
        return sum(max(0, sum(sizes[i] for i in b) - cap) for b in bins)

    bins = repaired_bins(sizes, k, cap)
    assert len(bins) <= k and sorted(i for b in bins for i in b) == list(range(len(sizes)))
    assert overflow(bins) <= overflow(repaired_bins(sizes, k, cap, steps=0))  # 0 steps: LPT


def test_agent_rows_reach_the_bound_in_large_blocks():
    """Blocks of 100-400 lognormal rows (agent steps) under the tightest cap that fits them into n / 10 micro-batches
    (under one token of slack per micro-batch): the count is ``ceil(tokens / cap)``. The former search missed it."""
    rng = np.random.default_rng(1)
    for n in (100, 200, 300, 400):
        rows = np.minimum(np.exp(rng.normal(7.0, 0.8, size=n)).astype(np.int64) + 1, 16_000)
        cap = max(int(rows.max()), math.ceil(rows.sum() / (n // 10)))
        one = np.zeros(n, dtype=np.int64), np.zeros(1, dtype=np.int64)
        p = pack_micro_batches(rows, *one, 1, cap)
        k = math.ceil(rows.sum() / cap)  # n / 10 unless the longest row is above that cap
        assert p.block_count[0] == p.block_lower_bound[0] == k
        assert all(rows[p.micro_index == m].sum() <= cap for m in range(k))


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
    from verl_traj.core.packing.padded_packing import least_area_runs as _least_area_runs, padded_runs as _padded_runs

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
    from verl_traj.integration.trainers.step_plan import verl_partitioner

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
    # BFD needs 4 bins and LPT does not fit 3; the caller's partitioner knows a 3-bin packing. It is asked where
    # the exact search ran out of budget (here: none at all)
    sizes, cap = [8, 6, 5, 5, 4, 3, 3, 2], 12
    calls = []

    def known(sizes_, k):
        calls.append(k)
        return [[0, 4], [1, 5, 6], [2, 3, 7]]

    packing = fewest_bins(sizes, cap, partitioner=known, budget=0)
    assert calls == [3] and sorted(map(sorted, packing.bins)) == [[0, 4], [1, 5, 6], [2, 3, 7]]
    assert packing.lower_bound == 3
    assert len(min_micro_batches(sizes, cap, partitioner=known)) == 3 and calls == [3]  # the exact search finds it


def test_row_above_cap_is_refused():
    with pytest.raises(PackingError, match="below the longest row"):
        pack_micro_batches(np.array([5, 12]), np.zeros(2, dtype=np.int64), np.zeros(1, dtype=np.int64), 1, 10)
