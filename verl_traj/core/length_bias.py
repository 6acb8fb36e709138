"""The length bias of what a step trains (issue 43, item 1): the trajectories trained against every trajectory that
finished or was cut in the same step, by length (tokens, turns), in all and per cause. Pure: numpy only.

Every asynchronous decision is correlated with length: a long, many-turn trajectory takes longest to generate, so it
is the one that is stale when the trainer wants it, the one that times out, the one still running when its group is
dropped. A policy trained on what survives is trained on a sample biased toward short trajectories. These metrics say
by how much, every step:

* ``traj_bias/{tokens,turns}_mean_ratio``: mean length of the trajectories trained / mean length of all that
  finished or were cut this step (trained + every cause). 1.0: no length bias; 0.9: what trains is 10% shorter than
  what the agent produced.
* ``traj_bias/{tokens,turns}_ks``: the Kolmogorov-Smirnov distance between the two length distributions (0: the
  same; 1: disjoint), which also catches a bias that leaves the mean alone (the tail cut, the middle kept).
* per cause ``c`` (``stale``, ``failed``, ``timeout``, ``deferred``, ...): ``traj_bias/{c}_share`` (of all
  trajectories) and ``traj_bias/{c}_tokens_mean_ratio`` (its mean length / all's mean: above 1, it removes the long
  ones).

With nothing cut every ratio is 1 and every distance 0, exactly, so the metrics are logged every step (zeros and ones
mean "no bias", not "not measured").

A failed or timed-out trajectory (:data:`CENSORED`) stopped before its end: its length is a lower bound of what it
would have been (right-censored). Counting it at its cut length makes "all" look shorter than the agent's trajectories
are, and a policy that loses the long ones to failures can look biased toward *long* (scripts/bench_async_bias.py:
1.15 for a true 0.88). So "all" is the Kaplan-Meier estimate of the length distribution from the complete lengths
(trained, and every other cause: stale and filtered trajectories finished) and the censored ones: the ratio's
denominator its restricted mean, the distance against its distribution function. Without a censored one it is the
empirical distribution, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from verl_traj.core.errors import TrajInputError

__all__ = ["CENSORED", "Lengths", "bias_metrics", "kaplan_meier", "ks_distance", "km_ks_distance", "mean_ratio"]

PREFIX = "traj_bias"
CENSORED = frozenset({"failed", "timeout"})  # causes whose length is where the trajectory stopped, not its end


@dataclass(frozen=True)
class Lengths:
    """The lengths of a set of trajectories: ``tokens`` ``[n]`` (generated tokens, or all tokens: the same measure in
    every set compared) and ``turns`` ``[n]`` (LLM calls), non-negative, one entry per trajectory."""

    tokens: np.ndarray
    turns: np.ndarray

    @classmethod
    def of(cls, tokens, turns) -> "Lengths":
        t, u = np.asarray(tokens, dtype=np.float64).reshape(-1), np.asarray(turns, dtype=np.float64).reshape(-1)
        if t.shape != u.shape:
            raise TrajInputError(f"length bias: {t.size} token counts for {u.size} turn counts: one of each per "
                                 "trajectory", field="traj_bias")
        if not (np.all(np.isfinite(t)) and np.all(np.isfinite(u)) and np.all(t >= 0) and np.all(u >= 0)):
            raise TrajInputError("length bias: a trajectory length is negative or not finite", field="traj_bias")
        return cls(t, u)

    @classmethod
    def concat(cls, parts: "list[Lengths]") -> "Lengths":
        if not parts:
            return cls(np.zeros(0), np.zeros(0))
        return cls(np.concatenate([p.tokens for p in parts]), np.concatenate([p.turns for p in parts]))

    def __len__(self) -> int:
        return int(self.tokens.size)


def mean_ratio(part: np.ndarray, whole: np.ndarray) -> float:
    """``mean(part) / mean(whole)``; 1.0 where either is empty or ``whole``'s mean is 0 (no length to be biased in)."""
    if part.size == 0 or whole.size == 0:
        return 1.0
    denominator = float(whole.mean())
    return float(part.mean()) / denominator if denominator > 0 else 1.0


def ks_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Kolmogorov-Smirnov distance ``sup_x |F_a(x) - F_b(x)|`` of the two samples' empirical distributions, in
    ``[0, 1]``; 0.0 where either is empty. One sort of each; exact (the supremum is reached at a sample point)."""
    if a.size == 0 or b.size == 0:
        return 0.0
    a, b = np.sort(a), np.sort(b)
    points = np.concatenate([a, b])
    fa = np.searchsorted(a, points, side="right") / a.size
    fb = np.searchsorted(b, points, side="right") / b.size
    return float(np.abs(fa - fb).max())


def kaplan_meier(values: np.ndarray, complete: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(x [k], survival [k])``: the Kaplan-Meier estimate of ``P(length > x)`` at each distinct value ``x``
    (ascending) of ``values`` ``[n]``, where ``complete`` ``[n]`` (bool) marks the lengths observed to their end and
    the rest are right-censored (the length is at least that). At a tie a censored length is at risk at the ended
    ones' value (the usual convention). All complete: ``1 - ECDF``."""
    x, index = np.unique(values, return_inverse=True)
    ended = np.bincount(index, weights=complete.astype(np.float64), minlength=x.size)
    gone = np.bincount(index, minlength=x.size).astype(np.float64)
    at_risk = values.size - np.concatenate([[0.0], np.cumsum(gone)[:-1]])
    return x, np.cumprod(1.0 - ended / at_risk)


def _restricted_mean(x: np.ndarray, survival: np.ndarray) -> float:
    """``integral_0^max(x) S(t) dt`` of the step function ``S`` (1 below ``x[0]``, ``survival[j]`` on
    ``[x[j], x[j+1])``): the mean where the last length is complete."""
    return float(x[0] + (survival[:-1] * np.diff(x)).sum()) if x.size else 0.0


def km_ks_distance(sample: np.ndarray, x: np.ndarray, survival: np.ndarray) -> float:
    """``sup_t |F_sample(t) - (1 - S(t))|`` of an empirical distribution and a Kaplan-Meier one (both
    right-continuous steps: the supremum is at a jump of either); 0.0 for an empty sample or estimate."""
    if sample.size == 0 or x.size == 0:
        return 0.0
    sample = np.sort(sample)
    points = np.concatenate([sample, x])
    at = np.searchsorted(x, points, side="right") - 1  # the last estimate step at or below each point
    cdf = np.where(at >= 0, 1.0 - survival[np.maximum(at, 0)], 0.0)
    return float(np.abs(np.searchsorted(sample, points, side="right") / sample.size - cdf).max())


def _reference(values: np.ndarray, complete: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """``(mean, x, survival)`` of every length (``complete`` as in :func:`kaplan_meier`): the empirical
    distribution where nothing is censored (``survival = 1 - ECDF``, the plain mean), the Kaplan-Meier one and its
    restricted mean where something is. One estimate per measure, read by every ratio and distance of it."""
    if complete.all():  # the exact path reads only the mean
        return (float(values.mean()) if values.size else 0.0), values[:0], values[:0]
    x, survival = kaplan_meier(values, complete)
    return _restricted_mean(x, survival), x, survival


def _versus(mine: np.ndarray, reference: tuple[float, np.ndarray, np.ndarray], exact: bool,
            values: np.ndarray) -> tuple[float, float]:
    """``(mean ratio, distance)`` of ``mine`` against the reference (:func:`_reference`); ``exact``: nothing
    censored, so the plain two-sample functions (bit-for-bit the metrics without censoring)."""
    if exact:
        return mean_ratio(mine, values), ks_distance(mine, values)
    mean, x, survival = reference
    return (float(mine.mean()) / mean if mine.size and mean > 0 else 1.0), km_ks_distance(mine, x, survival)


def bias_metrics(trained: Lengths, cut: Mapping[str, Lengths], prefix: str = PREFIX) -> dict[str, float]:
    """The step's length-bias metrics (module docstring): ``trained`` the trajectories the step trains, ``cut`` per
    cause those that finished or were cut this step and do not train (a cause with none may be given, empty); the
    lengths of :data:`CENSORED` causes are where the trajectory stopped."""
    causes = sorted(cut)
    everyone = Lengths.concat([trained, *(cut[c] for c in causes)])
    complete = np.concatenate([np.ones(len(trained), bool)] + [np.full(len(cut[c]), c not in CENSORED, bool)
                                                             for c in causes])
    out: dict[str, float] = {f"{prefix}/trajectories_trained": float(len(trained)),
                             f"{prefix}/trajectories_cut": float(len(everyone) - len(trained))}
    exact = bool(complete.all())
    references = {m: _reference(getattr(everyone, m), complete) for m in ("tokens", "turns")}
    for measure, reference in references.items():
        ratio, distance = _versus(getattr(trained, measure), reference, exact, getattr(everyone, measure))
        out[f"{prefix}/{measure}_mean_ratio"], out[f"{prefix}/{measure}_ks"] = ratio, distance
    all_mean = references["tokens"][0]
    for cause in causes:
        lengths = cut[cause]
        out[f"{prefix}/{cause}_share"] = len(lengths) / len(everyone) if len(everyone) else 0.0
        out[f"{prefix}/{cause}_tokens_mean_ratio"] = (float(lengths.tokens.mean()) / all_mean
                                                      if len(lengths) and all_mean > 0 else 1.0)
    return out
