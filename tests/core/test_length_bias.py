"""The length-bias metrics (issue 43, item 1), against brute-force definitions, with hypothesis."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_traj.core.errors import TrajInputError
from verl_traj.core.length_bias import Lengths, bias_metrics, ks_distance, mean_ratio

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


@settings(max_examples=200, deadline=None)
@given(lengths.filter(bool), st.dictionaries(st.sampled_from(["stale", "failed", "timeout"]), lengths, max_size=3))
def test_bias_metrics_match_their_definitions(trained, cut):
    """Means over the trained and over everyone (trained + every cause), shares of everyone, and no bias (ratio 1,
    distance 0) exactly when nothing is cut."""
    tr = Lengths.of(trained, [t // 100 for t in trained])
    cuts = {c: Lengths.of(v, [t // 100 for t in v]) for c, v in cut.items()}
    out = bias_metrics(tr, cuts)
    everyone = trained + [t for v in cut.values() for t in v]
    mean_all = np.mean(everyone)
    expected = np.mean(trained) / mean_all if mean_all > 0 else 1.0
    assert out["traj_bias/tokens_mean_ratio"] == pytest.approx(expected)
    assert out["traj_bias/tokens_ks"] == pytest.approx(_ks_brute(trained, everyone), abs=1e-12)
    assert out["traj_bias/trajectories_cut"] == len(everyone) - len(trained)
    for c, v in cut.items():
        assert out[f"traj_bias/{c}_share"] == pytest.approx(len(v) / len(everyone))
        assert out[f"traj_bias/{c}_tokens_mean_ratio"] == pytest.approx(
            np.mean(v) / mean_all if v and mean_all > 0 else 1.0)
    if not any(cut.values()):
        assert out["traj_bias/tokens_mean_ratio"] == 1.0 and out["traj_bias/tokens_ks"] == 0.0
        assert out["traj_bias/turns_mean_ratio"] == 1.0 and out["traj_bias/turns_ks"] == 0.0


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
