"""Prefix-tree plans (issue 29, item 4): property tests over random batches of GRPO groups of multi-turn trajectories
whose rows share prompts and turn prefixes (some merge chains broken), at dp 1-4 with and without a token cap.

Invariants, recomputed by brute force from the plan: every real row exactly once; whole units per mini-batch; equal
rows per rank and equal micro-batch counts per rank within a mini-batch, every micro-batch holding a row; each
micro-batch's real tree (built from its rows) within the cap, padding included; a unit whose tree fits the cap in one
micro-batch on one rank (atomic); a unit over the cap cut into pieces that each fit; the planned tree tokens = the
distinct prefixes of each piece (>= what the micro-batch's tree holds); metrics finite.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl_traj.core import PlanError, build_layout_from_counts, plan_mini_batches
from verl_traj.core.errors import TrajInputError
from verl_traj.core.packing.packing import PackingError
from verl_traj.core.trees.prefix_tree import tree_token_count
from verl_traj.core.plan.tree_planning import _cut, unit_pieces
from verl_traj.core.trees.tree_cost import TreeCostModel, tree_cost_model
from verl_traj.core.trees.tree_facts import micro_batch_tree_facts
from verl_traj.integration.trainers.tree_plan_facts import tree_choice

PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PAD_ID = 0


@st.composite
def tree_batches(draw):
    """``(rows, uid, traj, step)``: 2-6 groups of 1-4 trajectories of 1-4 step rows; each group one prompt, each
    step row its trajectory's context + observation + action; a broken chain re-encodes the last action token."""
    tok = st.integers(1, 9)
    rows, uid, traj, step = [], [], [], []
    for g in range(draw(st.integers(2, 6))):
        prompt = draw(st.lists(tok, min_size=1, max_size=12))
        for s in range(draw(st.integers(1, 4))):
            context = list(prompt)
            for t in range(draw(st.integers(1, 4))):
                row = context + draw(st.lists(tok, min_size=1, max_size=6))
                rows.append(row)
                uid.append(f"g{g}"), traj.append(f"g{g}/{s}"), step.append(t)
                context = row[:-1] + [draw(tok)] if draw(st.booleans()) else list(row)
    return rows, uid, traj, step


def _layout(rows, uid, traj, step):
    return build_layout_from_counts(np.array([len(r) for r in rows]), np.ones(len(rows), dtype=np.int64), uid,
                                    traj_id=traj, step_index=step)


def _rows_of(plan, rows, sel):
    """Token ids of the planned rows ``sel`` (padding rows as the v1 driver writes them: two pad ids)."""
    return [rows[s] if s >= 0 else [PAD_ID] * plan.spec.pad_row_tokens for s in plan.order.numpy()[sel].tolist()]


def check_tree_plan(plan, rows, lay, m_count, dp, group_by, cap, cost=None):
    order, mb, mi = plan.order.numpy(), plan.mini_batch_id.numpy(), plan.micro_batch_id.numpy()
    rank, pad = plan.rank.numpy(), plan.is_padding.numpy()
    assert sorted(order[~pad].tolist()) == list(range(len(rows)))
    unit = (lay.group_index if group_by == "group" else lay.traj_index).numpy()
    s = plan.stats
    for m in range(m_count):
        counts, rows_per_rank = [], []
        for r in range(dp):
            sel = (mb == m) & (rank == r)
            rows_per_rank.append(int(sel.sum()))
            ids = np.unique(mi[sel])
            assert ids.tolist() == list(range(ids.size))  # dense, every micro-batch holds a row
            counts.append(ids.size)
            for k in ids.tolist():
                part = sel & (mi == k)
                if cap is not None:
                    assert tree_token_count(_rows_of(plan, rows, part))[0] <= cap
        assert len(set(rows_per_rank)) == 1 and len(set(counts)) == 1 and counts[0] == s.micro_batches[m]
    place = {}
    for i in np.flatnonzero(~pad).tolist():
        place.setdefault(unit[order[i]], set()).add((mb[i], rank[i], mi[i]))
    for u, where in place.items():
        assert len({w[0] for w in where}) == 1  # whole units per mini-batch
        members = [rows[j] for j in np.flatnonzero(unit == u).tolist()]
        tokens, _ = tree_token_count(members)
        pays = cost is None or bool(cost.pays(np.array([tokens]), np.array([sum(map(len, members))]))[0])
        if (cap is None or tokens <= cap) and pays:
            assert len(where) == 1  # atomic: one micro-batch on one rank
    planned = int(s.tree_tokens.sum())
    held = sum(tree_token_count(_rows_of(plan, rows, (mb == m) & (rank == r) & (mi == k) & ~pad))[0]
               for m in range(m_count) for r in range(dp) for k in np.unique(mi[(mb == m) & (rank == r)]).tolist())
    assert held <= planned <= sum(len(r) for r in rows)
    metrics = plan.metrics("p")
    assert all(math.isfinite(v) for v in metrics.values())
    assert 0.0 <= metrics["p/atomic_trajectory_share"] <= 1.0
    if cost is None and (cap is None or all(tree_token_count([rows[j] for j in np.flatnonzero(unit == u).tolist()])[0]
                                            <= cap for u in place)):
        assert metrics["p/atomic_trajectory_share"] == 1.0


@PROPS
@given(batch=tree_batches(), dp=st.integers(1, 4), cap=st.sampled_from([None, 24, 40, 200]),
       group_by=st.sampled_from(["group", "trajectory"]), balance=st.booleans(), seed=st.integers(0, 3))
def test_tree_plan_invariants(batch, dp, cap, group_by, balance, seed):
    rows, uid, traj, step = batch
    lay = _layout(rows, uid, traj, step)
    cap = None if cap is None else max(cap, max(len(r) for r in rows) + 2)
    units = lay.num_groups if group_by == "group" else lay.num_trajectories
    m_count = min(2, units)
    plan = plan_mini_batches(lay, m_count, dp, group_by=group_by, balance_dp=balance, micro_batch_max_tokens=cap,
                             seed=seed, prefix_tree=True, rows=rows)
    check_tree_plan(plan, rows, lay, m_count, dp, group_by, cap)


@PROPS
@given(batch=tree_batches(), dp=st.integers(1, 3), cap=st.sampled_from([None, 24, 40]),
       tree_token=st.floats(0.3, 3.0), margin=st.floats(0.0, 0.5), seed=st.integers(0, 3))
def test_a_piece_whose_tree_does_not_pay_is_placed_as_rows(batch, dp, cap, tree_token, margin, seed):
    """Issue 55, item 1: with the device's cost model the planner keeps a unit whole (one tree) where its tree pays,
    and cuts it into its rows where it does not, so a micro-batch of such rows fits the cap as rows and the decision per
    micro-batch can run it as rows. Every tree-plan invariant still holds (a cut unit is not atomic)."""
    rows, uid, traj, step = batch
    lay = _layout(rows, uid, traj, step)
    cap = None if cap is None else max(cap, max(len(r) for r in rows) + 2)
    cost = TreeCostModel(tree_token=tree_token, margin=margin)
    m_count = min(2, lay.num_groups)
    plan = plan_mini_batches(lay, m_count, dp, micro_batch_max_tokens=cap, seed=seed, prefix_tree=True, rows=rows,
                             tree_cost=cost)
    check_tree_plan(plan, rows, lay, m_count, dp, "group", cap, cost)
    order, pad = plan.order.numpy(), plan.is_padding.numpy()
    unit = lay.group_index.numpy()
    members = [[rows[j] for j in np.flatnonzero(unit == u)] for u in range(lay.num_groups)]
    whole = [tree_token_count(m)[0] <= (cap or 10**9) for m in members]
    pays = [bool(cost.pays(np.array([tree_token_count(m)[0]]), np.array([sum(map(len, m))]))[0]) for m in members]
    where = plan.rank.numpy() * 10**6 + plan.mini_batch_id.numpy() * 10**3 + plan.micro_batch_id.numpy()
    for w in np.unique(where[~pad]).tolist():
        sel = (where == w) & ~pad
        if cap is not None and all(whole[unit[o]] and not pays[unit[o]] for o in order[sel]):
            assert sum(len(rows[o]) for o in order[sel]) <= cap  # rows that do not pay fit as rows


def test_low_sharing_groups_over_the_cap_run_as_rows_where_trees_do_not_pay():
    """Regression (issue 55): GRPO groups sharing 10 of 100 tokens per row, each group's rows over the cap. Priced in
    tree tokens only, every micro-batch held a whole group whose rows exceed the cap, so the per-micro-batch decision
    could never choose rows (a full micro-batch stays a tree). With the CUDA cost model the groups are cut into rows and
    every micro-batch runs as rows; with the CPU model (trees pay at any sharing) nothing changes."""
    rows = [[1000 + g] * 10 + [g * 100 + i] * 90 for g in range(8) for i in range(4)]
    uid = [f"g{i // 4}" for i in range(32)]
    lay = _layout(rows, uid, [f"t{i}" for i in range(32)], [0] * 32)
    cap = 380  # a group's tree is 370 tokens, its rows 400

    def share(cost):
        plan = plan_mini_batches(lay, 2, 2, micro_batch_max_tokens=cap, prefix_tree=True, rows=rows, tree_cost=cost)
        check_tree_plan(plan, rows, lay, 2, 2, "group", cap, cost)
        part = (plan.rank * 100 + plan.mini_batch_id * 10 + plan.micro_batch_id).numpy()
        planned = _rows_of(plan, rows, np.ones(len(part), dtype=bool))
        _, metrics = tree_choice(micro_batch_tree_facts(planned, part), np.arange(len(part)), part,
                                     cost or tree_cost_model("cuda"), cap)
        return metrics["actor/tree_share"]

    assert share(None) == 1.0  # stuck: every micro-batch's rows exceed the cap
    assert share(tree_cost_model("cuda")) == 0.0
    assert share(tree_cost_model("cpu")) == 1.0


def test_grpo_group_is_one_tree_and_rows_pay_the_prompt_once():
    """A GRPO group of 8 rows behind a 100-token prompt: one piece of 100 + 7 branch copies + 8 x 20 tokens, on one
    rank; two identical rows are one 60-token tree."""
    prompt = list(range(1, 101))
    rows = [prompt + [200 + i] * 20 for i in range(8)] + [[300 + j for j in range(50)] + [7] * 10 for _ in range(2)]
    uid = ["a"] * 8 + ["b"] * 2
    lay = _layout(rows, uid, [f"{u}{i}" for i, u in enumerate(uid)], [0] * 10)
    plan = plan_mini_batches(lay, 1, 2, micro_batch_max_tokens=400, prefix_tree=True, rows=rows)
    assert int(plan.stats.tree_tokens.sum()) == (100 + 7 + 8 * 20) + 60
    a_rows = np.isin(plan.order.numpy(), np.arange(8))
    assert len(set(plan.rank.numpy()[a_rows].tolist())) == 1
    check_tree_plan(plan, rows, lay, 1, 2, "group", 400)


def test_unit_over_the_cap_is_cut_into_pieces_that_repay_their_path():
    """Four 60-token rows sharing 40 tokens under a cap of 110: the whole unit is 40 + 3 branch copies + 4 x 20 = 123;
    cut depth-first into 3 rows (60 + 2 x 21 = 102) and 1 row that re-pays the 40-token path (60)."""
    rows = [list(range(40)) + [100 + i] * 20 for i in range(4)]
    pieces = unit_pieces(rows, np.zeros(4, dtype=np.int64), 1, 110)
    assert pieces.tokens.tolist() == [102, 60] and pieces.unit_tokens.tolist() == [123]
    assert sorted(pieces.of_row.tolist()) == [0, 0, 0, 1]
    assert unit_pieces(rows, np.zeros(4, dtype=np.int64), 1, None).tokens.tolist() == [123]


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30), st.integers(1, 30)), max_size=40),
       st.integers(30, 90))
def test_units_are_cut_as_the_row_by_row_greedy_cuts_them(rows, cap):
    """The cut, all units at once, equals the obvious greedy over each unit's rows (a run grows while its first row
    whole plus what each later row adds fits ``cap``)."""
    rows = sorted(rows)
    unit = np.asarray([u for u, _, _ in rows], dtype=np.int64)
    lengths = np.asarray([length for _, length, _ in rows], dtype=np.int64)
    added = np.minimum(np.asarray([a for _, _, a in rows], dtype=np.int64), lengths)
    unit_tokens = np.bincount(unit, weights=added, minlength=4).astype(np.int64)
    local, count, costs = _cut(unit, lengths, added, unit_tokens, cap)
    want_local, want_count, want_costs = [], [1, 1, 1, 1], []
    for u in range(4):
        members = np.flatnonzero(unit == u).tolist()
        if unit_tokens[u] <= cap:
            want_local += [0] * len(members)
            continue
        runs: list[int] = []
        for i in members:
            if runs and runs[-1] + added[i] <= cap:
                runs[-1] += int(added[i])
            else:
                runs.append(int(lengths[i]))
            want_local.append(len(runs) - 1)
        want_count[u], want_costs = len(runs), want_costs + runs
    assert local.tolist() == want_local and count.tolist() == want_count and costs.tolist() == want_costs


def test_refusals_name_the_field():
    rows = [[1, 2, 3], [1, 2, 4]]
    lay = _layout(rows, ["a", "a"], ["a0", "a1"], [0, 0])
    with pytest.raises(TrajInputError) as err:
        plan_mini_batches(lay, 1, 1, prefix_tree=True)
    assert err.value.field == "rows"
    with pytest.raises(TrajInputError) as err:
        plan_mini_batches(lay, 1, 1, prefix_tree=True, rows=[[1, 2, 3], [1, 2]])
    assert err.value.field == "rows[1]"
    with pytest.raises(PackingError) as err:
        plan_mini_batches(lay, 1, 1, prefix_tree=True, rows=rows, micro_batch_max_tokens=2)
    assert err.value.field == "micro_batch_max_tokens"
    with pytest.raises(PlanError) as err:
        plan_mini_batches(lay, 1, 1, prefix_tree="yes", rows=rows)
    assert err.value.field == "prefix_tree"


def test_all_trajectories_atomic_says_whether_the_loss_can_take_gspo_s_ratio():
    rows = [list(range(40)) + [100 + i] * 20 for i in range(4)]
    lay = _layout(rows, ["a"] * 4, ["t"] * 4, [0, 1, 2, 3])
    assert plan_mini_batches(lay, 1, 1, prefix_tree=True, rows=rows, micro_batch_max_tokens=400).all_trajectories_atomic
    # a cap under the trajectory's tree cuts it into pieces: not atomic; a row plan never is
    assert not plan_mini_batches(lay, 1, 1, prefix_tree=True, rows=rows, micro_batch_max_tokens=110).all_trajectories_atomic
    assert not plan_mini_batches(lay, 1, 1).all_trajectories_atomic
