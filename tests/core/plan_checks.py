"""Brute-force checks of a mini-batch plan, shared by the planner's property tests and the real-data tests."""

from __future__ import annotations

import math

import numpy as np

from verl_traj.core import calculate_workload


def _block_tokens(plan, tokens, m, r):
    """Attended tokens of rank r's rows of mini-batch m (padding rows included), and the selector."""
    sel = (plan.mini_batch_id.numpy() == m) & (plan.rank.numpy() == r)
    src = plan.order.numpy()[sel]
    return np.where(src >= 0, tokens[np.maximum(src, 0)], plan.spec.pad_row_tokens), sel


def check_micro_batches(plan, tokens, cap):
    """Every micro-batch fits the cap under the plan's cost; ids dense per block; counts synced; stats."""
    mi = plan.micro_batch_id.numpy()
    s = plan.stats
    area = plan.spec.micro_batch_cost == "padded_area"  # the cap bounds rows x longest, else the token sum
    for m in range(plan.num_mini_batches):
        counts, waste, longest_sum = [], 0, 0
        for r in range(plan.dp_size):
            t, sel = _block_tokens(plan, tokens, m, r)
            mis = mi[sel]
            for k in np.unique(mis):
                part = t[mis == k]
                assert (part.size * part.max() if area else part.sum()) <= cap
                waste += int(part.size * part.max() - part.sum())
                longest_sum = max(longest_sum, int(part.sum()))
            assert sorted(np.unique(mis).tolist()) == list(range(int(np.unique(mis).shape[0])))
            counts.append(int(np.unique(mis).shape[0]))
            assert counts[-1] >= math.ceil(t.sum() / cap)
        assert max(counts) == s.micro_batches[m] and min(counts) == max(counts)
        assert s.ranks_short_of_rows[m] == 0
        assert s.padded_positions[m] == waste and s.max_packed_tokens[m] == longest_sum


def check_plan(b, lay, plan, M, dp, group_by, workload="verl", cap=None):
    """Every invariant of a plan, recomputed by brute force."""
    order = plan.order.numpy()
    mbid = plan.mini_batch_id.numpy()
    pad = plan.is_padding.numpy()
    B_out = order.shape[0]
    real_src = np.flatnonzero(~b.is_padding)
    # every real row exactly once; no input padding row survives
    assert sorted(order[~pad].tolist()) == real_src.tolist()
    assert np.all(order[pad] == -1)
    # rank-major, equal rows per rank per mini-batch
    assert B_out % dp == 0
    per_rank = B_out // dp
    rows_per_rank = plan.rows_per_rank.numpy()
    assert rows_per_rank.sum() == per_rank and np.all(rows_per_rank >= 1)
    expected_mb = np.repeat(np.arange(M), rows_per_rank)
    for r in range(dp):
        assert mbid[r * per_rank : (r + 1) * per_rank].tolist() == expected_mb.tolist()
    assert plan.rank.tolist() == np.repeat(np.arange(dp), per_rank).tolist()
    # no unit split; exactly M non-empty mini-batches
    traj = lay.traj_index.numpy()
    grp = lay.group_index.numpy()
    unit = grp if group_by == "group" else traj
    src_mb = {}
    for i in np.flatnonzero(~pad):
        src_mb.setdefault(unit[order[i]], set()).add(mbid[i])
        assert len(src_mb[unit[order[i]]]) == 1
    assert plan.split_trajectories == 0
    if group_by == "group":
        assert plan.split_groups == 0
    # padding: fewest rows, zero loss tokens
    n_real = np.bincount(mbid[~pad], minlength=M)
    n_pad = np.bincount(mbid[pad], minlength=M)
    assert np.all(n_real >= 1)
    assert n_pad.tolist() == ((-n_real) % dp).tolist()
    s = plan.stats
    assert s.padding_rows.tolist() == n_pad.tolist()
    assert s.padding_tokens.tolist() == (n_pad * plan.spec.pad_row_tokens).tolist()
    # statistics = brute force
    tokens = b.num_tokens
    loss = b.loss_len
    for m in range(M):
        rows = order[(mbid == m) & ~pad]
        assert s.real_rows[m] == rows.shape[0]
        assert s.loss_tokens[m] == loss[rows].sum()
        assert s.tokens[m] == tokens[rows].sum()
        assert s.trajectories[m] == len(set(traj[rows].tolist()))
        assert s.groups[m] == len(set(grp[rows].tolist()))
        rank_w = []
        for r in range(dp):
            sel = (mbid == m) & (plan.rank.numpy() == r)
            src = order[sel]
            t = np.where(src >= 0, tokens[np.maximum(src, 0)], plan.spec.pad_row_tokens)
            w = calculate_workload(t, workload)
            rank_w.append(int(w.sum()))
            assert s.rank_workload[m, r] == rank_w[-1]
            real_src_r = src[src >= 0]
            assert s.rank_tokens[m, r] == tokens[real_src_r].sum()
            assert s.rank_loss_tokens[m, r] == loss[real_src_r].sum()
        assert s.max_rank_workload[m] == max(rank_w)
        all_t = np.where(order[mbid == m] >= 0, tokens[np.maximum(order[mbid == m], 0)], plan.spec.pad_row_tokens)
        w_all = calculate_workload(all_t, workload)
        assert s.workload_lower_bound[m] == max(math.ceil(int(w_all.sum()) / dp), int(w_all.max()))
        assert s.max_rank_workload[m] >= s.workload_lower_bound[m]
    assert s.loss_tokens.sum() == loss[real_src].sum()
    if cap is not None:
        check_micro_batches(plan, tokens, cap)
    # the plan's per-row facts: trajectory index carried from the layout, -1 on padding
    assert plan.traj_index[plan.is_padding].eq(-1).all()
    assert plan.traj_index[~plan.is_padding].tolist() == traj[order[~pad]].tolist()
    metrics = plan.metrics("p")
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())
    assert metrics["p/padding_rows"] == n_pad.sum()
    assert metrics["p/split_trajectories"] == 0.0


def fewest_bins_brute(sizes: list[int], cap: int) -> int:
    """Fewest bins of ``cap`` that hold ``sizes`` (every row ``<= cap``), by a dynamic program over subsets: the
    brute-force optimum the packers are checked against (tiny inputs only: ``2^len(sizes)`` states)."""
    n = len(sizes)
    load = [sum(sizes[i] for i in range(n) if mask >> i & 1) for mask in range(1 << n)]
    best = [0] + [n + 1] * ((1 << n) - 1)
    for mask in range(1, 1 << n):
        low = mask & -mask  # the bin holding the lowest row of mask: every sub-mask with it that fits
        sub = mask
        while sub:
            if sub & low and load[sub] <= cap:
                best[mask] = min(best[mask], best[mask ^ sub] + 1)
            sub = (sub - 1) & mask
    return best[-1]
