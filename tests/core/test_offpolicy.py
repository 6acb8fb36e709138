"""``verl_traj.core.rollout.offpolicy``: each trajectory's max lag, the groups past the cap, the token-weighted lag
percentile, the weights' health figures, the gate's hysteresis, and the bounded read's sample of whole trajectories,
against brute-force references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_traj.core.rollout.offpolicy import (HEALTH, HealthGate, HealthThresholds, first_version, gate_statistics, groups_over_lag,
                                      lag_stats, sample_trajectory_rows, weight_health)
from verl_traj.core.rollout.staleness import version_tokens

LEDGER = st.lists(st.tuples(st.integers(0, 6), st.integers(0, 40)), max_size=6).map(version_tokens)


@given(st.lists(LEDGER, max_size=6))
def test_first_version_is_the_oldest_generated_tokens(ledgers):
    assert first_version(ledgers) == min((v for ledger in ledgers for v, n in ledger if n > 0), default=None)


@given(st.dictionaries(st.sampled_from("abcdef"), st.lists(LEDGER, max_size=3), max_size=5), st.integers(6, 9),
       st.integers(1, 6))
def test_groups_over_lag_are_those_with_a_token_past_the_cap(groups, trained, cap):
    expected = {uid for uid, ledgers in groups.items()
                if any(trained - v > cap for ledger in ledgers for v, n in ledger if n > 0)}
    assert groups_over_lag(groups, trained, cap) == expected


def test_a_partial_rollout_is_capped_by_its_oldest_token_not_its_mean():
    """Token staleness 0.1 (one old token in ten), lag 5: past a cap of 4 however fresh the rest is."""
    ledgers = {"partial": [[[0, 1], [5, 9]]], "fresh": [[[5, 10]]]}
    assert groups_over_lag(ledgers, 5, 4) == {"partial"}
    assert groups_over_lag(ledgers, 5, 5) == set()


@given(st.lists(LEDGER, min_size=1, max_size=5), st.integers(6, 9))
def test_lag_p99_is_the_token_weighted_percentile(ledgers, trained):
    lags = sorted(trained - v for ledger in ledgers for v, n in ledger for _ in range(n))
    stats = lag_stats(ledgers, trained)
    if not lags:
        assert stats == {"traj_offpolicy/lag_max": 0.0, "traj_offpolicy/lag_p99": 0.0}
        return
    assert stats["traj_offpolicy/lag_max"] == lags[-1]
    assert stats["traj_offpolicy/lag_p99"] == lags[math.ceil(0.99 * len(lags)) - 1]  # the smallest with >= 99% below


def _reference_health(log_ratio: np.ndarray, cap: float) -> tuple[float, float, float, float]:
    w = np.exp(log_ratio.astype(np.float64))
    c = np.minimum(w, cap)
    n = w.size
    return (w.sum() ** 2 / (n * (w ** 2).sum()), c.sum() ** 2 / (n * (c ** 2).sum()), float((w > cap).mean()),
            float((w - c).sum() / w.sum()), float((np.log(w) ** 2).mean()))


@settings(deadline=None)
@given(st.lists(st.floats(-3, 3), min_size=1, max_size=40), st.floats(0.5, 5.0))
def test_weight_health_matches_the_definitions(values, cap):
    log_ratio = torch.tensor(values, dtype=torch.float32)
    got = weight_health(log_ratio, torch.ones_like(log_ratio, dtype=torch.bool), cap)
    want = _reference_health(log_ratio.numpy(), cap)
    assert [got[f"traj_offpolicy/{k}"] for k in HEALTH] == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_weight_health_does_not_overflow_and_reads_only_the_mask():
    """Sequence weights at agent lengths reach exp(1000): the shift keeps every figure finite; padding is ignored."""
    log_ratio = torch.tensor([[1000.0, 0.0, 5.0], [0.0, 0.0, 99.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    got = weight_health(log_ratio, mask, 2.0)
    assert got["traj_offpolicy/ess"] == pytest.approx(1 / 4)  # one weight carries everything among four
    assert got["traj_offpolicy/truncated_share"] == 0.25 and got["traj_offpolicy/truncated_mass"] == pytest.approx(1.0)
    assert weight_health(log_ratio, torch.zeros_like(mask), 2.0)["traj_offpolicy/ess"] == 1.0


def test_the_gate_opens_on_a_bad_step_and_closes_only_after_enough_healthy_ones():
    th = HealthThresholds(min_ess=0.3, max_log_ratio_m2=0.04, recover_ess=0.45, recover_log_ratio_m2=0.02,
                          recover_steps=3)

    def step(gate: HealthGate, ess: float, m2: float = 0.0) -> HealthGate:
        return gate.after({"traj_offpolicy/ess_truncated": ess, "traj_offpolicy/log_ratio_m2": m2,
                           "traj_offpolicy/ess": 0.0, "traj_offpolicy/truncated_mass": 1.0}, th)  # not read

    gate = step(HealthGate(), 0.5)
    assert not gate.active
    gate = step(gate, 0.29)
    assert gate.active and gate.steps_in_fallback == 1
    for ess in (0.5, 0.5, 0.4, 0.5, 0.5):  # 0.4 is above the entry threshold but below recovery: the count restarts
        gate = step(gate, ess)
        assert gate.active
    gate = step(gate, 0.5)
    assert not gate.active and gate.steps_in_fallback == 6
    assert step(HealthGate(), 0.9, m2=0.05).active  # log-ratios spread too wide open it too
    assert step(step(HealthGate(), 0.9, m2=0.05), 0.9, m2=0.03).active  # 0.03: under the entry, over recovery
    assert HealthGate().after({}, th) == HealthGate()  # no off-policy token: healthy
    assert HealthGate.from_state(gate.state_dict()) == gate and HealthGate.from_state(None) == HealthGate()


def test_the_gate_reads_statistics_one_token_cannot_swing():
    """Regression (issue 53): a gate on the untruncated ESS opened at random under heavy-tailed drift (one token at
    verl's +-20 log-ratio bound carries all the weight). Student-t(3) log-ratios at drift 1e-3 x lag 4 over 2e5
    tokens, 20 draws: the untruncated ESS falls below 0.3 in some draw, the gate's two statistics stay healthy in
    every one; at drift 1e-2 x lag 8 the M2 passes 0.04 in every draw (the gate opens where drift is real)."""
    rng, th = np.random.default_rng(0), HealthThresholds()

    def draws(scale: float) -> list[dict]:
        out = []
        for _ in range(20):
            log_ratio = np.clip(scale * rng.standard_t(3, 200_000) / np.sqrt(3.0), -20.0, 20.0)
            out.append(weight_health(torch.from_numpy(log_ratio), torch.ones(log_ratio.size, dtype=torch.bool), 2.0))
        return out

    mild = draws(math.sqrt(1e-3 * 4))
    assert min(h["traj_offpolicy/ess"] for h in mild) < 0.3
    assert not any(th.unhealthy(*gate_statistics(h)) for h in mild)
    assert all(th.unhealthy(*gate_statistics(h)) for h in draws(math.sqrt(1e-2 * 8)))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 30), max_size=120), st.integers(1, 60), st.integers(0, 2**32 - 1))
def test_the_read_sample_is_whole_trajectories_within_the_budget(trajectory, budget, seed):
    """Under the budget every row; over it whole trajectories (every row of a chosen one), at most the budget unless
    one trajectory alone is over it, never none; the same for the seed, whatever the row order."""
    codes = np.array(trajectory, dtype=np.int64)
    rows = sample_trajectory_rows(codes, budget, seed)
    assert rows.dtype == np.int64 and np.all(np.diff(rows) > 0)
    if codes.size <= budget:
        assert rows.tolist() == list(range(codes.size))
        return
    chosen = set(codes[rows].tolist())
    assert chosen and set(np.flatnonzero(np.isin(codes, list(chosen))).tolist()) == set(rows.tolist())  # whole
    largest = np.bincount(codes).max()
    assert rows.size <= budget or len(chosen) == 1  # over it: the one trajectory taken first, alone
    assert rows.size <= max(budget, largest)  # whichever trajectory comes first (hypothesis: a 2-row one, budget 1)
    assert np.array_equal(rows, sample_trajectory_rows(codes, budget, seed))  # deterministic
    order = np.random.default_rng(seed).permutation(codes.size)
    assert set(codes[order][sample_trajectory_rows(codes[order], budget, seed)].tolist()) == chosen  # row order


def test_the_read_sample_changes_with_the_seed_and_covers_every_trajectory_over_seeds():
    """A seed per step: different steps read different trajectories, and over steps every one is read."""
    codes = np.repeat(np.arange(100), 3)  # 300 rows, 3 per trajectory, budget 30: 10 trajectories a step
    picks = [frozenset(codes[sample_trajectory_rows(codes, 30, seed)].tolist()) for seed in range(200)]
    assert all(len(p) == 10 for p in picks) and len(set(picks)) > 190
    assert set().union(*picks) == set(range(100))
