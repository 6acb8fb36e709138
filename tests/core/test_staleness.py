"""``verl_traj.core.rollout.staleness``: tokens per policy version, each trajectory's token staleness, the groups the bound
drops and the running groups ``defer`` waits for, against brute-force references."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from verl_traj.core.errors import TrajInputError
from verl_traj.core.rollout.staleness import (check_bound, groups_over_bound, groups_to_defer, stalest, staleness_of,
                                      token_staleness, token_staleness_metrics, version_tokens)

ATTEMPTS = st.lists(st.tuples(st.integers(0, 6), st.integers(0, 50)), max_size=8)  # (version, tokens) per attempt
LEDGER = ATTEMPTS.map(version_tokens)


@given(ATTEMPTS)
def test_version_tokens_sum_each_versions_attempts_in_version_order(attempts):
    pairs = version_tokens(attempts)
    assert [v for v, _ in pairs] == sorted({v for v, n in attempts if n > 0})
    for version, tokens in pairs:
        assert tokens == sum(n for v, n in attempts if v == version) > 0
    assert sum(n for _, n in pairs) == sum(n for _, n in attempts)  # nothing lost, nothing counted twice


def test_an_attempt_with_tokens_but_no_version_is_refused_and_an_empty_one_is_not():
    assert version_tokens([(None, 0), (3, 4)]) == [[3, 4]]  # an aborted attempt that generated nothing
    with pytest.raises(TrajInputError, match=r"global_steps.*None.*7 tokens.*max_staleness"):
        version_tokens([(3, 4), (None, 7)])


def _reference_staleness(ledger, trained):
    tokens = [trained - v for v, n in ledger for _ in range(n)]  # one entry per generated token
    return sum(tokens) / len(tokens) if tokens else 0.0


@given(st.lists(LEDGER, min_size=1, max_size=6), st.integers(6, 9))
def test_token_staleness_is_the_mean_over_generated_tokens_of_versions_behind(ledgers, trained):
    staleness, total = token_staleness(ledgers, trained)
    for ledger, s, n in zip(ledgers, staleness, total):
        assert s == pytest.approx(_reference_staleness(ledger, trained))
        assert n == sum(t for _, t in ledger)


def test_a_partial_rollout_half_old_half_current_is_half_a_version_stale():
    staleness, _ = token_staleness([[[4, 30], [5, 30]], [[3, 10]], []], trained_version=5)
    assert staleness.tolist() == [0.5, 2.0, 0.0]


@given(st.dictionaries(st.sampled_from(list("abcdef")), st.lists(LEDGER, min_size=1, max_size=4)),
       st.integers(6, 9), st.floats(1, 5))
def test_a_group_is_over_the_bound_when_any_of_its_trajectories_is(groups, trained, bound):
    over = groups_over_bound(groups, trained, bound)
    assert over == {uid for uid, ledgers in groups.items()
                    if any(_reference_staleness(ledger, trained) > bound for ledger in ledgers)}


@given(st.lists(LEDGER, max_size=6), st.integers(6, 9))
def test_the_stalest_trajectory_is_learnt_once_and_exact_at_every_step(group, trained):
    """A finished group's bound check reads one cached pair (the replay buffer's O(1) a poll): its staleness is
    exactly (==, not approximately) the largest of its trajectories' at any trained version."""
    pair = stalest(group)
    for version in (trained, trained + 3):
        assert staleness_of(pair, version) == max((_reference_staleness(ledger, version) for ledger in group),
                                                  default=0.0)


@given(st.integers(1, 30), st.integers(0, 30), st.floats(1, 6))
def test_defer_holds_a_running_group_in_time_and_never_one_dispatched_this_step(dispatch, later, bound):
    """The first step that holds a group dispatched at ``d`` (first tokens of version ``d - 1``) trains it within the
    bound once it finishes; a group dispatched at the current step is never held (the wait ends)."""
    steps = range(dispatch, dispatch + later + 1)
    held = [g for g in steps if groups_to_defer({"u": dispatch}, g, bound)]
    if held:
        assert (held[0] - 1) - (dispatch - 1) <= bound  # trained at the held step: its oldest tokens within the bound
        assert held == list(range(held[0], dispatch + later + 1))  # held from then on, until it finishes
    for g in steps:
        assert not groups_to_defer({"v": g}, g, bound)


def test_token_metrics_weigh_tokens_not_trajectories():
    out = token_staleness_metrics([[[5, 90]], [[3, 10]]], trained_version=5)
    assert out["traj_version/token_staleness_mean"] == pytest.approx(0.2)  # 10 of 100 tokens, 2 versions behind
    assert out["traj_version/token_staleness_max"] == 2.0
    assert out["traj_version/current_policy_token_share"] == pytest.approx(0.9)
    assert token_staleness_metrics([], 5) == {}


@pytest.mark.parametrize("bound", [0, 0.5, -1, float("nan"), float("inf"), True, "2"])
def test_a_bound_below_one_or_not_a_number_is_refused(bound):
    with pytest.raises(TrajInputError, match=r"traj.max_staleness.*at least 1.*Fix|traj.max_staleness.*null"):
        check_bound(bound)
    check_bound(None)
    check_bound(1)
    check_bound(2.5)
