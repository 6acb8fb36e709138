"""When a sequence IS weight over a whole trajectory degenerates: a closed form for ``traj.ratio_scope`` warnings.

Model (the one ``scripts/bench_ratio_scope.py`` simulates and measures through verl's own
``compute_rollout_correction_and_rejection_mask``): each loss token's log-ratio ``log pi_train - log pi_rollout`` is
i.i.d. ``N(-s^2/2, s^2)`` (``s``: the per-token mismatch spread; the mean makes ``E[ratio] = 1``). A sequence of
``n`` loss tokens then has the log weight ``X ~ N(-v/2, v)`` with ``v = n * s^2``, and verl's sequence IS weight
(``rollout_is=sequence``) is ``min(exp(X), c)`` with ``c = rollout_is_threshold`` (default 2.0). Its moments have a
closed form (lognormal truncated above), hence the normalised effective sample size that verl logs
(``rollout_corr/rollout_is_eff_sample_size``: over loss tokens, ``(sum w)^2 / (N sum w^2)``).

Everything depends on ``v = tokens x s^2`` only. With ``c = 2`` the ESS of one length is 0.91 at ``v = 0.1``,
0.63 at ``v = 1``, 0.50 at ``v`` ~= 1.95 (:data:`CRITICAL_LOG_WEIGHT_VARIANCE`) and 0.12 at ``v = 10``, and the
truncated weights' mean (the scale of the update) falls with it (0.16 at ``v = 10``). Evidence
(``python scripts/bench_ratio_scope.py``, verl's function on i.i.d. ``N(-s^2/2, s^2)`` per-token log-ratios, 72
workload x spread x scope cells): :func:`expected_ess` on the same lengths is within 0.04 of the measured ESS in 46 of
the 48 row / trajectory cells (within 0.09 in all). The 500 SWE-bench trajectories (median 7,866 loss tokens, 36
turns) measure 0.80 / 0.63 / 0.32 / 0.02 at trajectory scope for s = 0.005 / 0.01 / 0.02 / 0.05 (model 0.80 / 0.60
/ 0.31 / 0.03), against 0.96 / 0.91 / 0.79 / 0.52 at row scope (rows: median 71 loss tokens); 100-turn agents
(~22K loss tokens) 0.75 / 0.44 / 0.12 / 0.01 at trajectory scope.

The start-up warning (``verl_traj.integration.startup.checks.ratio_scope_warning``): :func:`degenerates` with the
largest loss-token count a trajectory can have (verl's agent loop caps a trajectory's response tokens, every turn
together, at ``data.max_response_length``) and a spread; a run-time check can read the spread from verl's logged
per-token chi-square (:func:`spread_from_chi2_token`: ``E[ratio^2] - 1 = exp(s^2) - 1`` under the model). The lower
SAFETY_BOUND clamp of verl (log weight >= -20) is ignored: weights below ``exp(-20)`` add nothing to either moment.

Pure module (math only).
"""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["CRITICAL_LOG_WEIGHT_VARIANCE", "DEGENERATE_ESS", "IS_THRESHOLD", "degenerates", "expected_ess",
           "expected_trajectory_ess", "max_loss_tokens", "spread_from_chi2_token", "truncated_weight_moments"]

IS_THRESHOLD = 2.0  # verl's rollout_is_threshold default
DEGENERATE_ESS = 0.5  # below this, half the batch's tokens carry the update


def _log_norm_cdf(z: float) -> float:
    """``log Phi(z)`` for the standard normal, accurate far into the lower tail (asymptotic series below -30)."""
    if z > -30.0:
        return math.log(0.5 * math.erfc(-z / math.sqrt(2.0)))
    return -0.5 * z * z - math.log(-z) - 0.5 * math.log(2.0 * math.pi) + math.log1p(-1.0 / (z * z))


def _logaddexp(x: float, y: float) -> float:
    """``log(exp(x) + exp(y))`` without overflow (``-inf`` allowed)."""
    hi, lo = max(x, y), min(x, y)
    return hi if lo == -math.inf else hi + math.log1p(math.exp(lo - hi))


def _log_moments(variance: float, threshold: float) -> tuple[float, float]:
    """``(log E[w], log E[w^2])`` of :func:`truncated_weight_moments` (finite however large ``variance`` is)."""
    if variance <= 0.0:
        w = min(1.0, threshold)
        return math.log(w), 2.0 * math.log(w)
    sd, a = math.sqrt(variance), math.log(threshold)
    log_p_high = _log_norm_cdf(-(a + 0.5 * variance) / sd)
    log_m1 = _logaddexp(_log_norm_cdf((a - 0.5 * variance) / sd), a + log_p_high)
    log_m2 = _logaddexp(variance + _log_norm_cdf((a - 1.5 * variance) / sd), 2.0 * a + log_p_high)
    return log_m1, log_m2


def truncated_weight_moments(variance: float, threshold: float = IS_THRESHOLD) -> tuple[float, float]:
    """``(E[w], E[w^2])`` of ``w = min(exp(X), threshold)``, ``X ~ N(-variance/2, variance)``.

    With ``a = log threshold``, ``sd = sqrt(variance)``, ``p = P(X > a)``:
    ``E[w] = Phi((a - variance/2) / sd) + threshold * p`` and
    ``E[w^2] = exp(variance) * Phi((a - 1.5 variance) / sd) + threshold^2 * p`` (evaluated in log space; both
    underflow to 0 past ``variance`` ~ 2,000)."""
    log_m1, log_m2 = _log_moments(variance, threshold)
    return math.exp(log_m1), math.exp(log_m2)


def expected_ess(loss_tokens: Sequence[float], spread: float, threshold: float = IS_THRESHOLD) -> float:
    """Expected normalised ESS over loss tokens (verl's definition) of a batch of sequences with these loss-token
    counts ``[n]``, each with its own sequence weight: ``(sum_i n_i E[w_i])^2 / (N sum_i n_i E[w_i^2])``,
    ``N = sum_i n_i``, ``w_i`` truncated at ``threshold`` with log-weight variance ``n_i * spread^2``. The
    population value: a finite batch's measured ESS scatters around it."""
    counts = [float(n) for n in loss_tokens if n > 0]
    if not counts:
        return 1.0
    log_first, log_second = -math.inf, -math.inf
    for n in counts:
        log_m1, log_m2 = _log_moments(n * spread * spread, threshold)
        log_first = _logaddexp(log_first, math.log(n) + log_m1)
        log_second = _logaddexp(log_second, math.log(n) + log_m2)
    return math.exp(2.0 * log_first - log_second - math.log(sum(counts)))


def expected_trajectory_ess(loss_tokens_per_trajectory: float, spread: float,
                            threshold: float = IS_THRESHOLD) -> float:
    """Expected ESS of ``traj.ratio_scope=trajectory`` sequence IS weights when every trajectory has this many loss
    tokens: ``E[w]^2 / E[w^2]`` at ``v = tokens * spread^2``. At SWE-bench's median trajectory (7,866 loss tokens):
    0.67 / 0.39 / 0.03 for s = 0.01 / 0.02 / 0.05 (the benchmark measures 0.63 / 0.32 / 0.02 over the real mix of
    lengths)."""
    return expected_ess([loss_tokens_per_trajectory], spread, threshold)


def _critical_variance(min_ess: float, threshold: float) -> float:
    """The ``v`` at which one length's expected ESS crosses ``min_ess`` (bisection in log space; the ESS falls
    monotonically with ``v``)."""
    lo, hi = -12.0, 8.0  # log v
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        log_m1, log_m2 = _log_moments(math.exp(mid), threshold)
        lo, hi = (mid, hi) if 2.0 * log_m1 - log_m2 > math.log(min_ess) else (lo, mid)
    return math.exp(0.5 * (lo + hi))


CRITICAL_LOG_WEIGHT_VARIANCE = _critical_variance(DEGENERATE_ESS, IS_THRESHOLD)  # ~1.95: tokens x s^2 at ESS 0.5


def max_loss_tokens(spread: float, min_ess: float = DEGENERATE_ESS, threshold: float = IS_THRESHOLD) -> float:
    """The most loss tokens one sequence (a trajectory at trajectory scope) can have before its expected ESS falls
    below ``min_ess``: ``v* / spread^2`` (``inf`` for ``spread == 0``). With c = 2 and ESS 0.5: ~78K / 19.5K / 4.9K /
    780 tokens at s = 0.005 / 0.01 / 0.02 / 0.05."""
    if spread <= 0.0:
        return math.inf
    v = CRITICAL_LOG_WEIGHT_VARIANCE if (min_ess, threshold) == (DEGENERATE_ESS, IS_THRESHOLD) \
        else _critical_variance(min_ess, threshold)
    return v / (spread * spread)


def degenerates(max_loss_tokens_per_trajectory: float, spread: float, min_ess: float = DEGENERATE_ESS,
                threshold: float = IS_THRESHOLD) -> bool:
    """True when a trajectory this long gets an expected trajectory-scope sequence-IS ESS below ``min_ess``, i.e.
    ``tokens * spread^2 > v*`` (~1.95 for ESS 0.5 at c = 2). Row scope is then the better-conditioned choice for
    ``rollout_is=sequence`` / ``seq_sum_*`` rejection (token-level and ``seq_mean_*`` modes do not compound)."""
    return expected_trajectory_ess(max_loss_tokens_per_trajectory, spread, threshold) < min_ess


def spread_from_chi2_token(chi2_token: float) -> float:
    """The per-token spread ``s`` implied by verl's ``rollout_corr/chi2_token`` (``E[ratio^2] - 1``), which is
    ``exp(s^2) - 1`` under the model: ``s = sqrt(log1p(chi2_token))`` (0 for a non-positive value)."""
    return math.sqrt(math.log1p(chi2_token)) if chi2_token > 0.0 else 0.0
