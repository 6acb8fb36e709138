"""The hard lag cap of ``traj.stale_groups=correct`` and the health of its importance weights (issue 53). Pure:
numpy and torch only.

**Lag.** A token's lag is how many policy versions lie between the policy that sampled it and the policy being
trained: at training step ``g`` verl's actor holds version ``g - 1``, so a token of version ``v`` has lag
``g - 1 - v``. A trajectory's **max lag** is its oldest token's (``trained - min version``); under ``correct`` no
trained token's lag passes ``traj.max_lag`` (:func:`groups_over_lag`: a finished group past it goes to the fallback,
``traj.correct_fallback``; a running group that would pass it at the next step is waited for under ``defer``, the
same rule as :func:`~verl_traj.core.rollout.staleness.groups_to_defer` with the cap as its bound). ``traj.max_staleness``
(token staleness, a mean) stays where the correction takes over: a group over it trains with its stale tokens
importance-weighted, and is counted.

**Health.** Within the cap the stale tokens train under verl's rollout correction, per token ``w = pi_old / pi_rollout``
truncated at ``C`` (``algorithm.rollout_correction.rollout_is_threshold``). Every async step logs, over the tokens of
the off-policy trajectories (those with a token of lag > 0) and over all (``*_all``), from the log-ratios
``log w`` (:func:`weight_health`):

* ``ess``: the effective sample size of the untruncated weights, ``(sum w)^2 / (N sum w^2)`` in ``(0, 1]``;
* ``ess_truncated``: the same of ``min(w, C)``;
* ``truncated_share``: the share of weights above ``C``; ``truncated_mass``: the share of the weights' mass cut
  off, ``sum max(w - C, 0) / sum w`` (the bias truncation buys its variance with);
* ``log_ratio_m2``: the mean squared log-ratio ``mean((log w)^2)`` (M2PO's second moment);

and over the trajectories ``lag_max`` and ``lag_p99`` (token-weighted, from their version tokens: :func:`lag_stats`).
The v1 trainer reads the weights of at most a few thousand rows a step, a seeded sample of whole trajectories
(:func:`sample_trajectory_rows`; every row under that), the lag from every row's tags.

**Acting on it.** :class:`HealthGate` keeps a state across steps with hysteresis: the fallback takes over (the next
samplings treat a group over ``traj.max_staleness`` as ``traj.correct_fallback`` does, instead of correcting it)
when ``ess_truncated`` falls below :attr:`HealthThresholds.min_ess` or ``log_ratio_m2`` (the mean squared
log-ratio, M2PO's statistic) passes :attr:`HealthThresholds.max_log_ratio_m2`; it hands back only after
:attr:`HealthThresholds.recover_steps` consecutive steps at ``recover_*``. The gate reads these two because they are
the stable ones: under heavy-tailed drift one token's weight carries the untruncated ``ess`` and ``truncated_mass``
(measured, Student-t log-ratios at verl's +-20 bound, 2e5 tokens, drift 1e-3 x lag 4: ``ess`` median 0.995, minimum
0.000 over 20 draws; ``truncated_mass`` median 0.000, maximum 0.459), so a gate on them opens at random; the truncated
weights' ESS (verl's own ``rollout_is_eff_sample_size``, whose docs warn below 0.3) and the second moment of the
log-ratios vary by less than 0.01 across the same draws and grow with drift x lag. Both untruncated figures are still
logged. Defaults: ESS 0.3 (verl) and M2 0.04 (M2PO's bound); recovery at 1.5x the ESS and half the M2, for 3 steps,
so one noisy step cannot toggle the gate; docs/trainers.md has the measurement (``scripts/bench_async_bias.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Optional, Sequence

import numpy as np
import torch

from verl_traj.core.rollout.staleness import VersionTokens, flat_version_tokens

__all__ = ["FALLBACKS", "HEALTH", "HealthGate", "HealthThresholds", "first_version", "gate_statistics",
           "groups_over_lag", "lag_stats", "past_cap", "sample_trajectory_rows", "weight_health"]

FALLBACKS = ("defer", "drop")  # traj.correct_fallback: what takes over past the cap, and while weights are unhealthy
PREFIX = "traj_offpolicy"
HEALTH = ("ess", "ess_truncated", "truncated_share", "truncated_mass", "log_ratio_m2")  # weight_health's figures


def first_version(ledgers: Sequence[VersionTokens]) -> Optional[int]:
    """The oldest version with a generated token among ``ledgers`` (None: no token): a finished group is past the cap
    at trained version ``g`` iff ``g - first_version > cap`` (:func:`groups_over_lag`), learnt once."""
    versions = [int(v) for ledger in ledgers for v, n in ledger if n > 0]
    return min(versions) if versions else None


def past_cap(first: Optional[int], trained_version: int, cap: int) -> bool:
    """Whether a group whose oldest generated token is of version ``first`` (:func:`first_version`; None: no token)
    has a token more than ``cap`` versions behind ``trained_version``: the one rule of the cap, read by
    :func:`groups_over_lag` and, from each finished group's cached ``first``, by the replay buffer's policy."""
    return first is not None and trained_version - first > cap


def groups_over_lag(ledgers: Mapping[str, Sequence[VersionTokens]], trained_version: int, cap: int) -> set[str]:
    """The groups (``uid`` -> its trajectories' version tokens) with a token more than ``cap`` versions behind
    ``trained_version``."""
    return {uid for uid, group in ledgers.items() if past_cap(first_version(group), trained_version, cap)}


def lag_stats(ledgers: Sequence[VersionTokens], trained_version: int) -> dict[str, float]:
    """``lag_max`` (the oldest trained token's lag) and ``lag_p99`` (the 99th percentile over generated tokens,
    token-weighted) of ``T`` trajectories' version tokens; zeros for no token."""
    _, version, tokens = flat_version_tokens(ledgers)
    keep = tokens > 0
    if not keep.any():
        return {f"{PREFIX}/lag_max": 0.0, f"{PREFIX}/lag_p99": 0.0}
    lag, tokens = trained_version - version[keep], tokens[keep]
    order = np.argsort(lag, kind="stable")
    cumulative = np.cumsum(tokens[order])
    p99 = lag[order][np.searchsorted(cumulative, 0.99 * cumulative[-1])]
    return {f"{PREFIX}/lag_max": float(lag.max()), f"{PREFIX}/lag_p99": float(p99)}


def weight_health(log_ratio: torch.Tensor, mask: torch.Tensor, truncation: float,
                  suffix: str = "") -> dict[str, float]:
    """:data:`HEALTH` (module docstring) of the weights
    ``exp(log_ratio)`` where ``mask``; ``log_ratio`` and ``mask`` any equal shape (``[rows, tokens]`` of token
    weights, ``[rows]`` of sequence weights), ``truncation`` the weights' cap ``C > 0``. The exponent is shifted by its
    maximum (every figure is a ratio, so the shift cancels) and run in fp64: no overflow at any lag. No weight: ESS 1,
    nothing truncated. Metric names ``traj_offpolicy/<name><suffix>``."""
    values = log_ratio.detach().to(torch.float64)[mask.bool()]
    names = [f"{PREFIX}/{name}{suffix}" for name in HEALTH]
    if values.numel() == 0:
        return dict(zip(names, (1.0, 1.0, 0.0, 0.0, 0.0)))
    top = values.max()
    scaled = torch.exp(values - top)  # w / max(w), in (0, 1]
    cap = float(np.exp(min(np.log(truncation) - float(top), 700.0)))  # C / max(w), possibly huge
    clipped = scaled.clamp(max=cap)
    n = values.numel()
    ess = float(scaled.sum() ** 2 / (n * (scaled ** 2).sum()))
    ess_truncated = float(clipped.sum() ** 2 / (n * (clipped ** 2).sum()))
    over = scaled > cap
    mass = float((scaled - clipped).sum() / scaled.sum())
    m2 = float((values ** 2).mean())
    return dict(zip(names, (ess, ess_truncated, float(over.double().mean()), mass, m2)))


def sample_trajectory_rows(trajectory: np.ndarray, budget: int, seed: int) -> np.ndarray:
    """The rows to read for :func:`weight_health` out of ``B`` rows, ``trajectory`` ``[B]`` each row's trajectory (any
    integer codes, any order): ``[K]`` int64, ascending indices into ``trajectory``.

    * ``B <= budget``: every row, ``arange(B)`` (nothing sampled, the figures exact);
    * else whole trajectories: the batch's distinct trajectories (sorted codes) in the order of
      ``numpy.random.default_rng(seed).permutation``, the longest prefix of it whose rows fit in ``budget``, at least
      its first trajectory. So ``K <= max(budget, most rows of one trajectory)``; a trajectory's rows are all in or
      all out (its own figures stay exact); the same set of trajectories and ``seed`` give the same trajectories,
      whatever the row order.

    Why 4096 rows (``OFFPOLICY_READ_ROWS`` of the v1 trainer's metrics): ``log_ratio_m2`` is a mean and the ESS a
    ratio of means over 4096 x R tokens (R ~ 500-4000: millions), so the tokens' own noise is negligible; what is
    left is the spread between trajectories, read whole (a cluster sample: the error goes as ``CV / sqrt(T)`` over
    the ``T = 4096 / rows per trajectory`` trajectories read). Measured (``scripts/bench_offpolicy_read.py``, 10^5
    rows of 512 tokens, half the trajectories at lags 1-4 with a per-trajectory drift up to their token noise): over 8
    steps the sample's ``log_ratio_m2`` is within 5% of all rows' on average (13% at worst) at 4 rows per
    trajectory, 8% (12%) at 16; ``ess_truncated`` within 0.003 (0.006). Small against the gate's thresholds, set 2x
    (M2) and 1.5x (ESS) apart (:class:`HealthThresholds`), with a fresh sample every step; 4x the rows would halve
    it at 4x the read. The read: 4096 rows x R x 16 bytes (verl's fp32, fp32, int64), 32 MB at R = 512, 250 MB at
    R = 4000, against 0.8 GB / 6 GB for 10^5 rows."""
    trajectory = np.asarray(trajectory).reshape(-1)
    if trajectory.size <= budget:
        return np.arange(trajectory.size, dtype=np.int64)
    _, code, rows = np.unique(trajectory, return_inverse=True, return_counts=True)
    order = np.random.default_rng(seed).permutation(rows.size)
    taken = max(int((np.cumsum(rows[order]) <= budget).sum()), 1)  # cumsum increases: the fitting ones are a prefix
    chosen = np.zeros(rows.size, dtype=bool)
    chosen[order[:taken]] = True
    return np.flatnonzero(chosen[code.reshape(-1)]).astype(np.int64)


@dataclass(frozen=True)
class HealthThresholds:
    """When :class:`HealthGate` hands over to the fallback, and back (module docstring): on ``ess_truncated`` and
    ``log_ratio_m2``. ``recover_*`` must be at least as healthy as the entry thresholds (hysteresis)."""

    min_ess: float = 0.3
    max_log_ratio_m2: float = 0.04
    recover_ess: float = 0.45
    recover_log_ratio_m2: float = 0.02
    recover_steps: int = 3

    def unhealthy(self, ess: float, m2: float) -> bool:
        return ess < self.min_ess or m2 > self.max_log_ratio_m2

    def healthy(self, ess: float, m2: float) -> bool:
        return ess >= self.recover_ess and m2 <= self.recover_log_ratio_m2


def gate_statistics(metrics: Mapping[str, float]) -> tuple[float, float]:
    """``(ess_truncated, log_ratio_m2)`` of a step's :func:`weight_health` (the gate's two statistics); a step
    without off-policy tokens reads as healthy."""
    return float(metrics.get(f"{PREFIX}/ess_truncated", 1.0)), float(metrics.get(f"{PREFIX}/log_ratio_m2", 0.0))


@dataclass(frozen=True)
class HealthGate:
    """Whether the fallback is active, the consecutive healthy steps counted toward handing back, and the steps
    spent in fallback so far. Immutable: :meth:`after` returns the next state."""

    active: bool = False
    healthy_steps: int = 0
    steps_in_fallback: int = 0

    def after(self, metrics: Mapping[str, float], thresholds: HealthThresholds) -> "HealthGate":
        """The state after one step whose :func:`weight_health` (over the off-policy trajectories) is ``metrics``;
        a step without off-policy tokens reads as healthy (ESS 1, M2 0)."""
        ess, m2 = gate_statistics(metrics)
        if not self.active:
            return HealthGate(True, 0, self.steps_in_fallback + 1) if thresholds.unhealthy(ess, m2) else self
        healthy = self.healthy_steps + 1 if thresholds.healthy(ess, m2) else 0
        if healthy >= thresholds.recover_steps:
            return HealthGate(False, 0, self.steps_in_fallback)
        return replace(self, healthy_steps=healthy, steps_in_fallback=self.steps_in_fallback + 1)

    def metrics(self) -> dict[str, float]:
        return {f"{PREFIX}/fallback_active": float(self.active)}

    def state_dict(self) -> dict[str, int]:
        return {"active": int(self.active), "healthy_steps": self.healthy_steps,
                "steps_in_fallback": self.steps_in_fallback}

    @classmethod
    def from_state(cls, state: Optional[Mapping[str, int]]) -> "HealthGate":
        if not state:
            return cls()
        return cls(bool(state["active"]), int(state["healthy_steps"]), int(state["steps_in_fallback"]))
