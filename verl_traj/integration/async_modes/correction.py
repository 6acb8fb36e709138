"""``traj.stale_groups=correct``'s start-up: the importance weight and truncation it trains stale tokens under, and
what it says (issue 53; :mod:`verl_traj.core.rollout.offpolicy`)."""

from __future__ import annotations

from typing import Any, Optional

from omegaconf import open_dict

from verl_traj.config import TrajConfig, TrajConfigError
from verl_traj.integration.config.access import flag_at, value_at

__all__ = ["correction_threshold", "settle_correction"]


def settle_correction(config: Any, traj_config: Optional[TrajConfig] = None) -> Optional[str]:
    """``traj.stale_groups=correct`` trains a group over ``traj.max_staleness`` with its stale tokens under verl's
    rollout correction, within ``traj.lag_cap`` and while the weights stay healthy
    (:mod:`verl_traj.core.rollout.offpolicy`): refused without token-level weights truncated at a plain threshold (sequence
    weights collapse at agent lengths, ``scripts/bench_async_bias.py``; a banded ``lower_upper`` threshold masks
    instead of truncating, which the health gate does not measure) or without the rollout's log-probs they weigh
    against. verl's own staleness drop (``max_off_policy_threshold``, 8 versions since dispatch) is turned off: the
    cap does its work per token. Returns what start-up says: the cap, the fallback, the gate, and that change."""
    traj_config = traj_config if traj_config is not None else TrajConfig.of(config)
    rollout_is = value_at(config, "algorithm.rollout_correction.rollout_is")
    if rollout_is != "token":
        raise TrajConfigError.invalid(
            "algorithm.rollout_correction.rollout_is", rollout_is,
            "is not a token-level importance weight, which traj.stale_groups=correct trains groups over "
            "traj.max_staleness with (sequence weights multiply every token's ratio: at agent lengths their effective "
            "sample size collapses, docs/trainers.md)", "set algorithm.rollout_correction.rollout_is=token, or "
            "traj.stale_groups=drop|defer")
    threshold = correction_threshold(config)
    if not flag_at(config, "actor_rollout_ref.rollout.calculate_log_probs"):
        raise TrajConfigError.invalid(
            "actor_rollout_ref.rollout.calculate_log_probs", False,
            "leaves the rows without the rollout's log-probs, which traj.stale_groups=correct weighs stale tokens "
            "against", "set actor_rollout_ref.rollout.calculate_log_probs=true")
    said = (f"traj.stale_groups=correct: groups over traj.max_staleness={traj_config.max_staleness} train with token "
            f"weights truncated at {threshold:g}; no trained token is more than traj.max_lag={traj_config.lag_cap} "
            f"versions old (a group past it: traj.correct_fallback={traj_config.correct_fallback}); the fallback "
            f"also takes over while the off-policy ESS of the truncated weights < {traj_config.offpolicy_min_ess:g} or "
            f"their mean squared log-ratio > {traj_config.offpolicy_max_log_ratio_m2:g} (traj_offpolicy/*)")
    sampler = config.trainer.v1.sampler
    if sampler.get("max_off_policy_threshold") is None or sampler.get("max_off_policy_strategy", "drop") != "drop":
        return said
    with open_dict(config):
        verl_threshold, sampler.max_off_policy_threshold = sampler.max_off_policy_threshold, None
    return (f"{said}. It set trainer.v1.sampler.max_off_policy_threshold={verl_threshold} -> null: verl's drop counts "
            "versions since dispatch and would cut the longest trajectories, where traj.max_lag bounds every token")


def correction_threshold(config: Any) -> float:
    """``algorithm.rollout_correction.rollout_is_threshold`` as the plain truncation ``C > 0`` that ``correct``
    needs; refused otherwise (a banded ``lower_upper`` form masks instead)."""
    value = value_at(config, "algorithm.rollout_correction.rollout_is_threshold")
    try:
        threshold = float(value) if not isinstance(value, bool) else float("nan")
    except (TypeError, ValueError):
        threshold = float("nan")
    if not threshold > 0:
        raise TrajConfigError.invalid(
            "algorithm.rollout_correction.rollout_is_threshold", value,
            "is not a plain truncation: traj.stale_groups=correct truncates token weights and logs what the "
            "truncation cuts (traj_offpolicy/truncated_*); a banded lower_upper threshold masks tokens instead",
            "set a positive number (verl's default 2.0)")
    return threshold
