"""``traj:`` against verl's own sections, and the verl settings the plan reads, through verl's own predicates.

:func:`validate_against_verl` cross-checks a parsed :class:`~verl_traj.config.TrajConfig` with verl's config (an
OmegaConf node or a plain mapping; sections may be missing). It runs once per job, on the driver, from
:func:`verl_traj.integration.startup.checks.check_startup`; the trainer's
:func:`~verl_traj.integration.config.verl_config.prepare_config` only adapts. It reads verl's config through
:mod:`verl_traj.integration.config.access`, as the adapters do. Each refusal is a
:class:`~verl_traj.config.TrajConfigError` naming the field, the value and the fix; a verl value of the wrong type
where a check reads it (``data.train_batch_size=abc``) is refused the same way instead of crashing the check.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from omegaconf import OmegaConf

from verl.trainer.distillation import is_distillation_enabled

from verl_traj.config import TrajConfig, TrajConfigError
from verl_traj.core.plan.estimators import step_row_refusal
from verl_traj.integration.config.access import (flag_at, int_at, parameter_sync_step, prompts_per_update, ulysses_size,
                                                 uses_critic, value_at)

__all__ = ["SUPPORTED_POLICY_LOSS_MODES", "validate_against_verl"]

# verl 0.9.1 policy loss fns that multiply the per-token loss by ``rollout_is_weights`` and then call
# ``agg_loss(pg_losses, response_mask, loss_agg_mode, **config.global_batch_info)``: exact with per-row weights.
SUPPORTED_POLICY_LOSS_MODES = ("vanilla", "dppo_tv", "dppo_kl", "gspo", "gpg", "clip_cov", "kl_cov", "dro", "cispo")
UNSUPPORTED_LOSS_REASONS = {  # why per-row weights cannot express what these verl 0.9.1 losses compute
    "sapo": " (sapo hard-codes seq-mean-token-mean aggregation inside the micro-batch)",
    "geo_mean": " (geo_mean takes a per-row geometric mean of the ratios inside the micro-batch and uses the IS "
                "weights in log space, so neither a global normaliser nor a trajectory-wide mean is a per-row weight)",
    "bypass_mode": " (bypass_mode recomputes its own IS weights per micro-batch and drops the given ones)",
}
def validate_against_verl(traj_config: TrajConfig, config: Any) -> None:
    """Cross-check ``traj:`` against verl's own sections (an OmegaConf/dict-like ``config``).

    Raises ``TrajConfigError`` naming the field, the value and the fix."""
    if not traj_config.enable:
        _check_stock_step_rows(traj_config, config)
        return
    _check_estimator(traj_config, config)
    _check_v1_row_fields(traj_config, config)
    _check_policy_loss(config)
    _check_distillation(config)
    _check_mini_batches(config)
    _check_token_caps(traj_config, config)


def _check_stock_step_rows(traj_config: TrajConfig, config: Any) -> None:
    """``traj.step_wise=true`` with ``traj.enable=false`` is stock verl on step rows (one row per LLM call, trained
    by verl's own mini-batches, for a side-by-side run): only v1 stores an agent loop's several outputs as rows."""
    if traj_config.step_wise and not flag_at(config, "trainer.use_v1", False):
        raise TrajConfigError(
            "traj.step_wise=true with traj.enable=false (stock verl on step rows) needs the v1 trainer: v0 has no "
            "step rows of its own. Fix: set trainer.use_v1=true, or traj.enable=true (verl_traj's step rows, v0 and "
            "v1), or traj.step_wise=false.", field="traj.step_wise")


def _check_estimator(traj_config: TrajConfig, config: Any) -> None:
    """Step rows take the estimators :func:`~verl_traj.core.plan.estimators.step_row_refusal` allows: the question the
    step-wise advantage path asks at run time, so start-up and run time cannot disagree."""
    reason = step_row_refusal(str(value_at(config, "algorithm.adv_estimator", "grpo"))) if traj_config.step_wise else ""
    if reason:
        raise TrajConfigError(reason, field="algorithm.adv_estimator")
    if flag_at(config, "algorithm.use_pf_ppo", False):
        raise TrajConfigError(
            "algorithm.use_pf_ppo=true resamples rows after the advantage step, which would break the planned "
            "mini-batches (whole units, padding rows, per-row loss weights). Fix: set algorithm.use_pf_ppo=false, or "
            "traj.enable=false.", field="algorithm.use_pf_ppo")


def _check_v1_row_fields(traj_config: TrajConfig, config: Any) -> None:
    """On v1 a row's trajectory and step are its TransferQueue key (``{uid}_{session}_{index}``), not batch fields:
    ``traj.traj_id_key`` / ``traj.step_index_key`` name v0's fields and would be ignored there."""
    if not flag_at(config, "trainer.use_v1", False):
        return
    defaults = {f.name: f.default for f in fields(TrajConfig)}
    for name in ("traj_id_key", "step_index_key"):
        if getattr(traj_config, name) != defaults[name]:
            raise TrajConfigError(
                f"traj.{name}={getattr(traj_config, name)!r} has no effect on the v1 trainer (trainer.use_v1=true): "
                "there a row's trajectory and step are read from its TransferQueue key {uid}_{session}_{index}, which "
                f"verl's agent-loop worker writes. Fix: remove the traj.{name} override, or set trainer.use_v1=false "
                "to use the v0 trainer, which reads these non_tensor_batch fields.", field=f"traj.{name}")


def _check_policy_loss(config: Any) -> None:
    """Policy losses that multiply their token losses by the given per-row weights; no bypass mode, no prefix
    grouper."""
    mode = value_at(config, "actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla")
    if not isinstance(mode, str) or mode not in SUPPORTED_POLICY_LOSS_MODES:
        raise TrajConfigError(
            f"actor_rollout_ref.actor.policy_loss.loss_mode={mode!r} is not supported with traj.enable=true: "
            "verl_traj folds the mini-batch-global loss normalisation (and, with step rows, the trajectory-scoped "
            "rollout correction) into per-token weights, which needs a policy loss fn that multiplies its token "
            f"losses by rollout_is_weights{UNSUPPORTED_LOSS_REASONS.get(str(mode), '')}. Fix: use one of "
            f"{list(SUPPORTED_POLICY_LOSS_MODES)}, or set traj.enable=false.",
            field="actor_rollout_ref.actor.policy_loss.loss_mode")
    if flag_at(config, "algorithm.rollout_correction.bypass_mode", False):
        raise TrajConfigError(
            "algorithm.rollout_correction.bypass_mode=true is not supported with traj.enable=true: verl then swaps the "
            "policy loss for its 'bypass_mode' loss, which computes its own IS weights per micro-batch and is not "
            "normalised over the mini-batch. Fix: set algorithm.rollout_correction.bypass_mode=false (old log-probs "
            "are recomputed and the driver corrects, per trajectory with traj.ratio_scope=trajectory), or "
            "traj.enable=false.", field="algorithm.rollout_correction.bypass_mode")
    if flag_at(config, "actor_rollout_ref.actor.use_prefix_grouper", False):
        raise TrajConfigError(
            "actor_rollout_ref.actor.use_prefix_grouper=true is not supported with traj.enable=true (it needs "
            "verl's group-contiguous balancing). Fix: set one of them to false.",
            field="actor_rollout_ref.actor.use_prefix_grouper")


def _check_distillation(config: Any) -> None:
    """verl's distillation loss is outside the per-row weights (verl's own ``is_distillation_enabled``)."""
    view = OmegaConf.create({"enabled": flag_at(config, "distillation.enabled", False)})
    if value_at(config, "distillation") is not None and is_distillation_enabled(view):
        raise TrajConfigError(
            "distillation.enabled=true, but verl_traj's loss aggregation does not cover verl's distillation loss. "
            "Fix: set traj.enable=false or distillation.enabled=false.", field="distillation.enabled")


def _check_mini_batches(config: Any) -> None:
    """Whole optimizer steps: the prompts of an update (``train_batch_size``; on v1 divided by
    ``parameter_sync_step``) a multiple of the actor's (and critic's) mini-batch, and the critic's mini-batches
    unions of the actor's (so both step on whole planned units)."""
    train_bs = prompts_per_update(config)
    label = "data.train_batch_size" + ("" if parameter_sync_step(config) == 1 else " / parameter_sync_step")
    mini = int_at(config, "actor_rollout_ref.actor.ppo_mini_batch_size", 0)
    if train_bs and (mini <= 0 or train_bs % mini):
        raise TrajConfigError(
            f"{label}={train_bs} is not a multiple of actor_rollout_ref.actor.ppo_mini_batch_size="
            f"{mini}: the number of mini-batches (optimizer steps per training step) must be whole. "
            "Fix: make train_batch_size a multiple of ppo_mini_batch_size.",
            field="actor_rollout_ref.actor.ppo_mini_batch_size")
    if not uses_critic(config) or not train_bs:
        return
    critic_mini = int_at(config, "critic.ppo_mini_batch_size", mini) or mini
    m_actor, ok = train_bs // mini, critic_mini > 0 and train_bs % critic_mini == 0
    if not ok or m_actor % (train_bs // critic_mini):
        raise TrajConfigError(
            f"critic.ppo_mini_batch_size={critic_mini} does not fit the actor's plan: with {label}="
            f"{train_bs} and actor_rollout_ref.actor.ppo_mini_batch_size={mini} the actor steps {m_actor} "
            "mini-batches of whole units, and each critic mini-batch must be a union of whole actor mini-batches. "
            f"Fix: set critic.ppo_mini_batch_size to a multiple of {mini} that divides {train_bs} (e.g. {mini}).",
            field="critic.ppo_mini_batch_size")


def _check_token_caps(traj_config: TrajConfig, config: Any) -> None:
    """An explicit training cap must hold a full-length row (per SP group: cap x Ulysses size)."""
    cap = traj_config.micro_batch_max_tokens
    if cap is None or (traj_config.step_wise and traj_config.merge_prefix):
        return  # derived caps are raised to the longest row; merged rows are checked per batch by the planner
    max_len = int_at(config, "data.max_prompt_length", 0, minimum=0) + int_at(config, "data.max_response_length", 0,
                                                                               minimum=0)
    sp = ulysses_size(value_at(config, "actor_rollout_ref.actor", {}))
    if max_len and cap * sp < max_len:
        need = -(-max_len // sp)
        raise TrajConfigError(
            f"traj.micro_batch_max_tokens={cap} (x ulysses_sequence_parallel_size={sp} = {cap * sp} tokens per "
            f"sequence-parallel group) is below data.max_prompt_length + data.max_response_length = {max_len}: "
            f"a full-length row could not fit in any micro-batch. Raise traj.micro_batch_max_tokens to at least "
            f"{need}.", field="traj.micro_batch_max_tokens")
