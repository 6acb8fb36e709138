"""The length bias of what a step trains (issue 43, item 1): the trajectories trained against every trajectory that
finished or was cut in the same step, by length (tokens, turns), in all and per cause. Pure: numpy only.

Every asynchronous decision is correlated with length: a long, many-turn trajectory takes longest to generate, so it
is the one that is stale when the trainer wants it, the one that times out, the one still running when its group is
dropped. A policy trained on what survives is trained on a sample biased toward short trajectories. These metrics say
by how much, every step:

* ``traj_bias/{tokens,turns}_mean_ratio``: mean length of the trajectories trained / mean length of all that
  finished or were cut this step (trained + every cause). 1.0: no length bias; 0.9: what trains is 10% shorter than
  what the agent produced. The bracket's upper end (below).
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

The bracket. The restricted mean integrates the estimate only up to the longest length observed: where a timeout cuts
at a length no finished trajectory passes, it counts every cut trajectory as ending at the cut, and the ratio reads
high (lognormal lengths, sigma 0.8, timeout at the p90 / p80 length: 0.858 / 0.806 for a true 0.761 / 0.646). So the
metrics are two ends, the step's truth between them (``m``: ``tokens``, ``turns``):

* upper, ``traj_bias/{m}_mean_ratio``: the Kaplan-Meier ratio above, raised by its truncation; an estimate, not a
  bound (SWE-bench turns cut by a token timeout at the median length: 0.743 for a true 0.755);
* lower, ``traj_bias/{m}_mean_ratio_lower``: every censored trajectory put at the agent's hard budget
  (:class:`LengthBudget`), which its true length cannot pass: the largest the true mean can be, a rigorous lower
  end. Not logged for a measure whose budget is unknown.

With nothing censored both are the plain ratio, bit for bit. How far to trust the upper end: ``traj_bias/km_tail_mass``
(tokens: the estimated probability of a length beyond the longest complete one, mass the estimate cannot place; 0
without censoring), ``traj_bias/censored_share`` and ``traj_bias/{c}_censored_share`` (``c`` in :data:`CENSORED`; of
all trajectories), ``traj_bias/upper_bound_only`` (1.0 where the tail mass is over :data:`TAIL_MASS_LIMIT` or
something was censored with no token budget known: the truncation dominates, the truth likely well below it).

Pooling: a median of per-step ratios hides the bias (1.000 where the pooled truth is 0.962). Each step logs the
ratios' parts, ``traj_bias/{m}_trained_mean``, ``traj_bias/{m}_all_mean`` (the upper end's denominator) and
``traj_bias/{m}_all_mean_at_budget`` (the lower end's), beside ``traj_bias/trajectories_{trained,cut}``:
:func:`pooled_bias` pools any steps exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

import numpy as np

from verl_traj.core.errors import TrajInputError, check_positive_number

__all__ = ["CENSORED", "LengthBudget", "Lengths", "TAIL_MASS_LIMIT", "bias_metrics", "budget_mean", "kaplan_meier",
           "km_ks_distance", "km_tail_mass", "ks_distance", "mean_ratio", "pooled_bias"]

PREFIX = "traj_bias"
CENSORED = frozenset({"failed", "timeout"})  # causes whose length is where the trajectory stopped, not its end
MEASURES = ("tokens", "turns")
# Above this Kaplan-Meier tail mass (traj_bias/km_tail_mass) the upper end is flagged a bound, not an estimate: its
# overstatement grows with the mass. Lognormal lengths (sigma 0.8), timeout leaving 2.5 / 5 / 10 / 20% censored: upper
# end 2-4 / 5-7 / 11-13 / 23-25% above the truth. At 0.05 an unflagged upper end is within a few percent of it.
TAIL_MASS_LIMIT = 0.05


@dataclass(frozen=True)
class LengthBudget:
    """The agent's hard budget: no trajectory generates over ``tokens`` tokens or makes over ``turns`` LLM calls
    (:class:`Lengths`' measures; ``None``: unknown; else positive, finite). The lower end puts censored ones there."""

    tokens: Optional[float] = None
    turns: Optional[float] = None

    def __post_init__(self) -> None:
        for measure in MEASURES:
            if getattr(self, measure) is not None:
                check_positive_number(f"LengthBudget.{measure}", getattr(self, measure),
                                      f"give the most {measure} a trajectory of the agent can reach, or None where "
                                      "nothing bounds it")


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


def km_tail_mass(values: np.ndarray, complete: np.ndarray) -> float:
    """The Kaplan-Meier survival (:func:`kaplan_meier`) at the largest complete length of ``values`` ``[n]``: the
    probability of a length beyond every one observed to its end, mass the estimate cannot place, in ``[0, 1]``.
    0.0 with nothing censored (or nothing at all); 1.0 with nothing complete."""
    if complete.all() or not complete.any():
        return 0.0 if complete.all() else 1.0
    x, survival = kaplan_meier(values, complete)
    return float(survival[np.searchsorted(x, values[complete].max())])


def budget_mean(values: np.ndarray, complete: np.ndarray, budget: float) -> float:
    """Mean of ``values`` ``[n]``, every censored one (``~complete``) put at ``budget``: the most the true mean can
    be. A budget under an observed length (not respected) is raised to it: never below the restricted mean."""
    if values.size == 0:
        return 0.0
    ceiling = max(float(budget), float(values.max()))
    return float(np.where(complete, values, ceiling).mean())


def _measure_metrics(prefix: str, measure: str, mine: np.ndarray, values: np.ndarray, complete: np.ndarray,
                     reference: tuple[float, np.ndarray, np.ndarray], budget: Optional[float]) -> dict[str, float]:
    """One measure's two ends, distance and their parts (module docstring): ``mine`` the trained lengths, ``values``
    / ``complete`` everyone's (``reference``: :func:`_reference`), ``budget`` the hard maximum (``None``: no lower)."""
    exact = bool(complete.all())
    ratio, distance = _versus(mine, reference, exact, values)
    name = f"{prefix}/{measure}"
    out = {f"{name}_mean_ratio": ratio, f"{name}_ks": distance,
           f"{name}_trained_mean": float(mine.mean()) if mine.size else 0.0, f"{name}_all_mean": reference[0]}
    if budget is not None:
        if exact:  # the plain ratio, bit for bit
            out[f"{name}_all_mean_at_budget"], out[f"{name}_mean_ratio_lower"] = reference[0], ratio
        else:  # max: >= the restricted mean in exact arithmetic; rounding must not put the lower end above the upper
            at_budget = max(budget_mean(values, complete, budget), reference[0])
            out[f"{name}_all_mean_at_budget"] = at_budget
            out[f"{name}_mean_ratio_lower"] = float(mine.mean()) / at_budget if mine.size and at_budget > 0 else 1.0
    return out


def _censoring_metrics(prefix: str, cut: Mapping[str, Lengths], tokens: np.ndarray, complete: np.ndarray,
                       budget: LengthBudget) -> dict[str, float]:
    """``censored_share``, ``{c}_censored_share`` per :data:`CENSORED` cause (0.0 where none), ``km_tail_mass``
    (:func:`km_tail_mass` of the ``tokens`` ``[n]`` of everyone) and ``upper_bound_only`` (module docstring)."""
    n, censored, tail = tokens.size, int((~complete).sum()), km_tail_mass(tokens, complete)
    out = {f"{prefix}/censored_share": censored / n if n else 0.0}
    for cause in sorted(CENSORED):
        out[f"{prefix}/{cause}_censored_share"] = len(cut[cause]) / n if n and cause in cut else 0.0
    out[f"{prefix}/km_tail_mass"] = tail
    out[f"{prefix}/upper_bound_only"] = float(tail > TAIL_MASS_LIMIT or (censored > 0 and budget.tokens is None))
    return out


def bias_metrics(trained: Lengths, cut: Mapping[str, Lengths], prefix: str = PREFIX,
                 budget: LengthBudget = LengthBudget()) -> dict[str, float]:
    """The step's length-bias metrics (module docstring): ``trained`` the trajectories the step trains, ``cut`` per
    cause those that finished or were cut this step and do not train (a cause with none may be given, empty); the
    lengths of :data:`CENSORED` causes are where the trajectory stopped. ``budget``: the agent's hard maximum per
    trajectory, the lower end of the bracket for each measure it gives."""
    causes = sorted(cut)
    everyone = Lengths.concat([trained, *(cut[c] for c in causes)])
    complete = np.concatenate([np.ones(len(trained), bool)] + [np.full(len(cut[c]), c not in CENSORED, bool)
                                                             for c in causes])
    out: dict[str, float] = {f"{prefix}/trajectories_trained": float(len(trained)),
                             f"{prefix}/trajectories_cut": float(len(everyone) - len(trained))}
    references = {m: _reference(getattr(everyone, m), complete) for m in MEASURES}
    for measure, reference in references.items():
        out.update(_measure_metrics(prefix, measure, getattr(trained, measure), getattr(everyone, measure), complete,
                                    reference, getattr(budget, measure)))
    all_mean = references["tokens"][0]
    for cause in causes:
        lengths = cut[cause]
        out[f"{prefix}/{cause}_share"] = len(lengths) / len(everyone) if len(everyone) else 0.0
        out[f"{prefix}/{cause}_tokens_mean_ratio"] = (float(lengths.tokens.mean()) / all_mean
                                                      if len(lengths) and all_mean > 0 else 1.0)
    out.update(_censoring_metrics(prefix, cut, everyone.tokens, complete, budget))
    return out


def _pooled_mean(steps: list[Mapping[str, float]], key: str, weights: np.ndarray) -> float:
    """``sum(w * row[key]) / sum(w)`` over ``steps`` (a row without ``key``: 0); 0.0 where the weights sum to 0."""
    values, total = np.array([float(r.get(key, 0.0)) for r in steps]), float(weights.sum())
    return float((weights * values).sum()) / total if total > 0 else 0.0


def pooled_bias(rows: Iterable[Mapping[str, float]], prefix: str = PREFIX) -> dict[str, float]:
    """The run's length bias from per-step metric dicts (``rows``, e.g. the logged metrics; a row without
    ``{prefix}/tokens_all_mean`` is skipped), pooled exactly: every trajectory of every step counts once.

    Per measure ``m`` (``tokens``, ``turns``), with ``T_s`` = ``trajectories_trained``, ``A_s`` = ``T_s +
    trajectories_cut`` of step ``s`` and trained = ``sum T_s * {m}_trained_mean / sum T_s``: ``{m}_mean_ratio`` (upper
    end) = trained / ``(sum A_s * {m}_all_mean / sum A_s)``, ``{m}_mean_ratio_lower`` = trained / ``(sum A_s *
    {m}_all_mean_at_budget / sum A_s)`` (only where every step logged it); 1.0 where nothing trained. Also ``steps``,
    ``trajectories_trained``, ``trajectories_all``, ``censored_share`` and ``{c}_censored_share`` (of all pooled
    trajectories), ``km_tail_mass_max``, ``upper_bound_only_steps`` (flagged) and ``upper_bound_only`` (1.0 where any
    step was). Keys without the prefix; ``{}`` where no row has the sums."""
    if not (steps := [r for r in rows if f"{prefix}/tokens_all_mean" in r]):
        return {}
    trained = np.array([float(r.get(f"{prefix}/trajectories_trained", 0.0)) for r in steps])
    everyone = trained + np.array([float(r.get(f"{prefix}/trajectories_cut", 0.0)) for r in steps])
    out = {"steps": float(len(steps)), "trajectories_trained": float(trained.sum()),
           "trajectories_all": float(everyone.sum())}
    for m in MEASURES:
        trained_mean = _pooled_mean(steps, f"{prefix}/{m}_trained_mean", trained)
        ends = {"": f"{m}_all_mean"}
        if all(f"{prefix}/{m}_all_mean_at_budget" in r for r in steps):
            ends["_lower"] = f"{m}_all_mean_at_budget"
        for suffix, key in ends.items():
            all_mean = _pooled_mean(steps, f"{prefix}/{key}", everyone)
            out[f"{m}_mean_ratio{suffix}"] = trained_mean / all_mean if trained.sum() > 0 and all_mean > 0 else 1.0
    for key in ["censored_share", *(f"{c}_censored_share" for c in sorted(CENSORED))]:
        out[key] = _pooled_mean(steps, f"{prefix}/{key}", everyone)
    flags = [float(r.get(f"{prefix}/upper_bound_only", 0.0)) > 0 for r in steps]
    out["km_tail_mass_max"] = max(float(r.get(f"{prefix}/km_tail_mass", 0.0)) for r in steps)
    out["upper_bound_only_steps"], out["upper_bound_only"] = float(sum(flags)), float(any(flags))
    return out
