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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from verl_traj.core.errors import TrajInputError

__all__ = ["Lengths", "bias_metrics", "ks_distance", "mean_ratio"]

PREFIX = "traj_bias"


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


def bias_metrics(trained: Lengths, cut: Mapping[str, Lengths], prefix: str = PREFIX) -> dict[str, float]:
    """The step's length-bias metrics (module docstring): ``trained`` the trajectories the step trains, ``cut`` per
    cause those that finished or were cut this step and do not train (a cause with none may be given, empty)."""
    everyone = Lengths.concat([trained, *cut.values()])
    out: dict[str, float] = {f"{prefix}/trajectories_trained": float(len(trained)),
                             f"{prefix}/trajectories_cut": float(len(everyone) - len(trained))}
    for measure in ("tokens", "turns"):
        mine, all_ = getattr(trained, measure), getattr(everyone, measure)
        out[f"{prefix}/{measure}_mean_ratio"] = mean_ratio(mine, all_)
        out[f"{prefix}/{measure}_ks"] = ks_distance(mine, all_)
    for cause, lengths in sorted(cut.items()):
        out[f"{prefix}/{cause}_share"] = len(lengths) / len(everyone) if len(everyone) else 0.0
        out[f"{prefix}/{cause}_tokens_mean_ratio"] = mean_ratio(lengths.tokens, everyone.tokens)
    return out
