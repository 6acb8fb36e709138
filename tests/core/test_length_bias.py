"""The length-bias metrics (issue 43, item 1), against brute-force definitions, with hypothesis."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_traj.core.errors import TrajInputError
from verl_traj.core.rollout.length_bias import CENSORED, Lengths, bias_metrics, ks_distance, mean_ratio

lengths = st.lists(st.integers(0, 5_000), min_size=0, max_size=40)


def _ks_brute(a, b) -> float:
    """sup over every real x of |F_a(x) - F_b(x)|, checked at every sample point and between them."""
    if not a or not b:
        return 0.0
    xs = sorted(set(a) | set(b))
    probes = xs + [x + 0.5 for x in xs] + [min(xs) - 1]
    return max(abs(sum(v <= x for v in a) / len(a) - sum(v <= x for v in b) / len(b)) for x in probes)


@settings(max_examples=200, deadline=None)
@given(lengths, lengths)
def test_ks_distance_is_the_supremum_of_the_two_empirical_distributions(a, b):
    assert ks_distance(np.array(a, float), np.array(b, float)) == pytest.approx(_ks_brute(a, b), abs=1e-12)


def _km_brute(values, complete):
    """P(length > t) at every integer t in [0, max], by the product-limit definition, one t at a time."""
    out = []
    for t in range(int(max(values)) + 1):
        s = 1.0
        for u in sorted({v for v, c in zip(values, complete) if c and v <= t}):
            at_risk = sum(v >= u for v in values)
            s *= 1 - sum(v == u and c for v, c in zip(values, complete)) / at_risk
        out.append(s)
    return out


def _versus_all_brute(mine, values, complete):
    """(mean ratio, KS distance) of ``mine`` against all lengths: plain where all are complete, else against the
    Kaplan-Meier estimate (its integral over [0, max] as the mean; its distribution at every integer)."""
    if all(complete):
        mean_all = np.mean(values)
        return (np.mean(mine) / mean_all if mean_all > 0 else 1.0), _ks_brute(mine, values)
    survival = _km_brute(values, complete)
    mean_all = sum(survival[:-1])
    ratio = np.mean(mine) / mean_all if mean_all > 0 else 1.0
    cdf = lambda t: 0.0 if t < 0 else 1 - survival[min(int(t), len(survival) - 1)]  # noqa: E731
    probes = range(-1, int(max(max(values), max(mine))) + 1)
    return ratio, max(abs(sum(v <= t for v in mine) / len(mine) - cdf(t)) for t in probes)


@settings(max_examples=200, deadline=None)
@given(lengths.filter(bool), st.dictionaries(st.sampled_from(["stale", "failed", "timeout"]), lengths, max_size=3))
def test_bias_metrics_match_their_definitions(trained, cut):
    """Means over the trained and over everyone (trained + every cause; failed and timed-out lengths censored: the
    Kaplan-Meier estimate), shares of everyone, and no bias (ratio 1, distance 0) exactly when nothing is cut."""
    tr = Lengths.of(trained, [t // 100 for t in trained])
    cuts = {c: Lengths.of(v, [t // 100 for t in v]) for c, v in cut.items()}
    out = bias_metrics(tr, cuts)
    everyone = trained + [t for c in sorted(cut) for t in cut[c]]
    complete = [True] * len(trained) + [c not in CENSORED for c in sorted(cut) for _ in cut[c]]
    ratio, distance = _versus_all_brute(trained, everyone, complete)
    assert out["traj_bias/tokens_mean_ratio"] == pytest.approx(ratio)
    assert out["traj_bias/tokens_ks"] == pytest.approx(distance, abs=1e-12)
    assert out["traj_bias/trajectories_cut"] == len(everyone) - len(trained)
    mean_all = np.mean(trained) / ratio if ratio > 0 and np.mean(trained) > 0 else None
    for c, v in cut.items():
        assert out[f"traj_bias/{c}_share"] == pytest.approx(len(v) / len(everyone))
        if mean_all:
            assert out[f"traj_bias/{c}_tokens_mean_ratio"] == pytest.approx(np.mean(v) / mean_all if v else 1.0)
    if not any(cut.values()):
        assert out["traj_bias/tokens_mean_ratio"] == 1.0 and out["traj_bias/tokens_ks"] == 0.0
        assert out["traj_bias/turns_mean_ratio"] == 1.0 and out["traj_bias/turns_ks"] == 0.0


def test_failed_lengths_are_censored_so_losing_the_long_ones_reads_as_short():
    """Regression (scripts/bench_async_bias.py, keep_survivors, 1% crashes a call): counting a failed trajectory at
    the length it reached made what trains look 15% *longer* than all when it was 12% shorter. Lengths of 1-100
    calls, each call crashing with probability 2%: the trained survivors are short of the truth, and the metric says
    so within 2% of the truth, where the cut-length mean says the opposite."""
    rng = np.random.default_rng(0)
    natural = rng.integers(1, 101, 20_000)
    crash = rng.geometric(0.02, natural.size)  # the call after which the session would crash
    survived = crash > natural
    trained = natural[survived]
    failed = np.minimum(crash, natural)[~survived]
    out = bias_metrics(Lengths.of(trained, trained), {"failed": Lengths.of(failed, failed)})
    truth = trained.mean() / natural.mean()
    assert truth < 0.8 and out["traj_bias/tokens_mean_ratio"] == pytest.approx(truth, rel=0.02)
    assert trained.mean() / np.concatenate([trained, failed]).mean() > 1.0  # the cut-length reading: "long"


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 5_000), min_size=2, max_size=40), st.integers(1, 1_000))
def test_cutting_the_longest_biases_short_and_scale_does_not_matter(values, scale):
    """Dropping the longest trajectory (what a staleness bound does to slow ones) gives a ratio <= 1, < 1 unless all
    are equal; a common unit (tokens vs thousands of tokens) changes nothing."""
    values = sorted(values)
    trained, longest = values[:-1], values[-1:]
    out = bias_metrics(Lengths.of(trained, trained), {"stale": Lengths.of(longest, longest)})
    assert out["traj_bias/tokens_mean_ratio"] <= 1.0
    assert (out["traj_bias/tokens_mean_ratio"] < 1.0) == (values[0] != values[-1])
    assert out["traj_bias/stale_tokens_mean_ratio"] >= 1.0
    scaled = bias_metrics(Lengths.of([v * scale for v in trained], trained),
                          {"stale": Lengths.of([v * scale for v in longest], longest)})
    assert scaled["traj_bias/tokens_mean_ratio"] == pytest.approx(out["traj_bias/tokens_mean_ratio"])
    assert scaled["traj_bias/tokens_ks"] == out["traj_bias/tokens_ks"]


def test_edges_and_refusals():
    assert mean_ratio(np.zeros(0), np.ones(3)) == 1.0 and mean_ratio(np.zeros(2), np.zeros(2)) == 1.0
    assert ks_distance(np.zeros(0), np.ones(3)) == 0.0 and ks_distance(np.array([1.0]), np.array([2.0])) == 1.0
    with pytest.raises(TrajInputError, match="one of each"):
        Lengths.of([1, 2], [1])
    with pytest.raises(TrajInputError, match="negative"):
        Lengths.of([-1], [1])
