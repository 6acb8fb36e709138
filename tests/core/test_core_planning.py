"""plan_mini_batches: invariants on random batches, statistics vs brute force, errors, determinism."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_traj.core import (
    PackingError,
    PlanError,
    build_layout_from_counts,
    mini_batch_order,
    plan_mini_batches,
)
from verl_traj.testing import random_batch

from tests.core.plan_checks import check_micro_batches, check_plan, fewest_bins_brute


def _layout(b):
    return b.layout()


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    groups=st.integers(1, 10),
    tpg=st.integers(1, 6),
    steps=st.integers(1, 50),
    dp=st.integers(1, 8),
    M=st.integers(1, 6),
    group_by=st.sampled_from(["group", "trajectory"]),
    balance=st.booleans(),
    workload=st.sampled_from(["verl", "tokens"]),
    tail=st.floats(0.2, 2.0),
    pad_rows=st.integers(0, 2),
    use_cap=st.booleans(),
    cost=st.sampled_from(["tokens", "padded", "padded_area"]),
    mb_balance=st.sampled_from(["tokens", "units"]),
)
def test_plan_invariants(seed, groups, tpg, steps, dp, M, group_by, balance, workload, tail, pad_rows, use_cap, cost,
                         mb_balance):
    b = random_batch(seed, groups, tpg, steps, heavy_tail=tail, pad_rows=pad_rows)
    lay = _layout(b)
    units = lay.num_groups if group_by == "group" else lay.num_trajectories
    cap = None
    if use_cap:
        cap = int(b.num_tokens.max()) * (1 + seed % 3)
    if units < M:
        with pytest.raises(PlanError, match=f"train batch has {units} .* but {M} mini-batches were configured"):
            plan_mini_batches(lay, M, dp, group_by=group_by)
        return
    plan = plan_mini_batches(
        lay, M, dp, group_by=group_by, balance_dp=balance, workload=workload, micro_batch_max_tokens=cap, seed=seed,
        micro_batch_cost=cost, mini_batch_balance=mb_balance,
    )
    check_plan(b, lay, plan, M, dp, group_by, workload, cap)
    if mb_balance == "units":
        per_mb = (plan.stats.groups if group_by == "group" else plan.stats.trajectories).numpy()
        assert per_mb.max() - per_mb.min() <= 1
    # units larger than a fair share are counted
    unit = (lay.group_index if group_by == "group" else lay.traj_index).numpy()
    real = ~b.is_padding
    unit_tokens = np.bincount(unit[real], weights=b.num_tokens[real])
    assert plan.units_larger_than_mini_batch == int((unit_tokens > b.num_tokens[real].sum() / M).sum())


def test_units_larger_than_a_mini_batch_are_kept_whole():
    # one giant group + small ones
    b = random_batch(1, 6, 3, 3)
    b.prompt_len[b.uid == b.uid[0]] += 50_000
    lay = _layout(b)
    plan = plan_mini_batches(lay, 3, 4)
    check_plan(b, lay, plan, 3, 4, "group")
    assert plan.units_larger_than_mini_batch >= 1
    assert plan.metrics()["traj_plan/units_larger_than_mini_batch"] >= 1


def test_deterministic_for_a_seed():
    b = random_batch(5, 8, 4, 20)
    lay = _layout(b)
    p1 = plan_mini_batches(lay, 4, 4, seed=3, micro_batch_max_tokens=20_000)
    p2 = plan_mini_batches(lay, 4, 4, seed=3, micro_batch_max_tokens=20_000)
    assert torch.equal(p1.order, p2.order) and torch.equal(p1.micro_batch_id, p2.micro_batch_id)


def test_fewer_units_than_mini_batches_message():
    b = random_batch(0, 3, 2, 2)
    with pytest.raises(PlanError, match=r"train batch has 3 groups .* but 4 mini-batches were configured \(train_batch_size / ppo_mini_batch_size\)"):
        plan_mini_batches(_layout(b), 4, 2)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(group_by="row"), "group_by"),
        (dict(workload="flops"), "workload"),
        (dict(micro_batch_max_tokens=0), "micro_batch_max_tokens"),
        (dict(mini_batch_balance="rows"), "mini_batch_balance"),
        (dict(micro_batch_cost="area"), "micro_batch_cost"),
        (dict(pad_row_tokens=1), "pad_row_tokens"),
        (dict(micro_batch_pass_cost=-1), "micro_batch_pass_cost=-1 must be a finite number >= 0"),
        (dict(micro_batch_pass_cost=float("nan")), "micro_batch_pass_cost=nan"),
        (dict(micro_batch_pass_cost="1024"), "micro_batch_pass_cost='1024'"),
    ],
)
def test_bad_config(kw, match):
    b = random_batch(0, 3, 2, 2)
    with pytest.raises(PlanError, match=match):
        plan_mini_batches(_layout(b), 1, 2, **kw)


def test_cap_below_longest_row():
    b = random_batch(0, 3, 2, 2)
    with pytest.raises(PackingError, match=f"below the longest row \\({int(b.num_tokens.max())} tokens\\)"):
        plan_mini_batches(_layout(b), 1, 2, micro_batch_max_tokens=int(b.num_tokens.max()) - 1)


def test_every_rank_reaches_the_synced_micro_batch_count():
    # one mini-batch, dp=2: one long row forces more micro-batches on its rank; with equal row counts per
    # rank (our layout) every other rank can always split as far, so no rank is ever short of rows
    uid = np.array([f"u{i}" for i in range(8)], dtype=object)
    tokens = np.array([100, 60, 60, 60, 5, 5, 5, 5])
    lay = build_layout_from_counts(tokens, np.ones(8, dtype=np.int64), uid)
    plan = plan_mini_batches(lay, 1, 2, micro_batch_max_tokens=100, workload="tokens")
    s = plan.stats
    assert s.micro_batches[0] >= 2
    assert s.ranks_short_of_rows.sum() == 0
    assert plan.metrics()["traj_plan/ranks_short_of_rows"] == 0.0
    mi, rank = plan.micro_batch_id, plan.rank
    assert len(set(mi[rank == 0].tolist())) == len(set(mi[rank == 1].tolist())) == s.micro_batches[0]


def test_mini_batch_order_same_everywhere_and_a_permutation():
    a = mini_batch_order(8, epoch=2, seed=7, shuffle=True)
    assert torch.equal(a, mini_batch_order(8, 2, 7, True))
    assert sorted(a.tolist()) == list(range(8))
    assert not all(torch.equal(a, mini_batch_order(8, e, 7, True)) for e in range(3, 8))
    assert mini_batch_order(5, 1, 0, False).tolist() == [0, 1, 2, 3, 4]
    assert mini_batch_order(5, 1, 0, True).dtype == torch.long


def test_balance_off_is_round_robin():
    b = random_batch(2, 4, 2, 5)
    lay = _layout(b)
    plan = plan_mini_batches(lay, 2, 3, balance_dp=False)
    check_plan(b, lay, plan, 2, 3, "group")


def _unit_tokens(b, lay, plan):
    """Per mini-batch: real tokens and units (groups)."""
    return plan.stats.tokens.numpy(), plan.stats.groups.numpy()


def test_mini_batch_balance_tokens_equalises_token_mass():
    """tokens (default): LPT on unit tokens -> every mini-batch within one largest unit of the fair share;
    the unit counts may differ (here by more than one)."""
    b = random_batch(7, 24, 4, 12, heavy_tail=1.5)
    lay = _layout(b)
    plan = plan_mini_batches(lay, 4, 2, mini_batch_balance="tokens")
    tokens, groups = _unit_tokens(b, lay, plan)
    unit_tokens = np.bincount(lay.group_index.numpy(), weights=b.num_tokens)
    assert tokens.max() - tokens.sum() / 4 <= unit_tokens.max()
    units = plan_mini_batches(lay, 4, 2, mini_batch_balance="units")
    u_tokens, u_groups = _unit_tokens(b, lay, units)
    assert groups.max() - groups.min() > 1 and u_groups.max() - u_groups.min() <= 1  # the trade-off
    assert tokens.max() <= u_tokens.max()


def test_mini_batch_balance_units_fixes_prompts_per_optimizer_step():
    """units: 10 groups over 4 mini-batches -> 3, 3, 2, 2 groups (a fixed prompt count, +-1), whole groups."""
    b = random_batch(3, 10, 3, 5)
    lay = _layout(b)
    plan = plan_mini_batches(lay, 4, 2, mini_batch_balance="units")
    check_plan(b, lay, plan, 4, 2, "group")
    assert sorted(plan.stats.groups.tolist()) == [2, 2, 3, 3]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), dp=st.integers(1, 3), M=st.integers(1, 2), slack=st.integers(0, 3))
def test_micro_batch_count_is_the_optimum_for_the_plans_ranks(seed, dp, M, slack):
    """The plan's micro-batches per mini-batch are the fewest possible once rows are on ranks (every rank runs the
    synced count): the max over ranks of each rank's optimum (brute force, padding rows included), which is also
    the reported lower bound; every micro-batch fits the cap."""
    b = random_batch(seed, 3, 2, 2)
    lay = _layout(b)
    tokens = b.num_tokens
    cap = int(tokens.max()) + slack * int(np.median(tokens))
    plan = plan_mini_batches(lay, min(M, lay.num_groups), dp, micro_batch_max_tokens=cap, seed=seed,
                             workload="tokens")
    check_micro_batches(plan, tokens, cap)
    order, mb, rank = plan.order.numpy(), plan.mini_batch_id.numpy(), plan.rank.numpy()
    lens = np.where(order >= 0, tokens[np.maximum(order, 0)], plan.spec.pad_row_tokens)
    for m in range(plan.num_mini_batches):
        optimum = max(fewest_bins_brute(lens[(mb == m) & (rank == r)].tolist(), cap) for r in range(dp))
        assert plan.stats.micro_batches[m] == plan.stats.micro_batches_lower_bound[m] == optimum
