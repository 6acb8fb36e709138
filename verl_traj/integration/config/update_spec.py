"""What both trainer adapters need for an update, derived once from verl's config and ``traj:`` at start-up.

:class:`UpdateSpec` is built in the trainer's ``__init__`` (v0 ``TrajRayPPOTrainer``, v1 ``TrajV1Mixin``), after
:func:`~verl_traj.integration.config.verl_config.prepare_config` has adapted verl's micro-batch settings (the sections
were validated once, at start-up: :func:`~verl_traj.integration.startup.checks.check_startup`). Both adapters read every
fact from it; none re-derives one from verl's config:

* the prompts of one planned update (``data.train_batch_size``, over v1's ``parameter_sync_step``), the number of
  (actor) mini-batches it is cut into, ``actor.ppo_epochs``;
* how many actor mini-batches one critic optimizer step takes (``critic.ppo_mini_batch_size``: a union factor);
* the actor's and the critic's loss aggregation (``traj.loss_agg_mode`` / ``traj.critic_loss_agg_mode``, else
  verl's ``loss_agg_mode``) with the constant ``S`` of ``seq-mean-token-sum-norm`` (``loss_scale_factor``, else
  ``data.max_response_length``: the same on both trainers and on every step, whatever the batch's response
  width; with step rows that width changes from step to step);
* the planner's seed of one update and the micro-batch settings (:class:`PlanSettings`);
* whether verl's rollout correction runs per trajectory (step rows at ``traj.ratio_scope=trajectory``) and whether the
  actor's rows carry their trajectory as ``ratio_group`` (GSPO there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from verl_traj.config import TrajConfig, TrajConfigError
from verl_traj.core import compute_loss_weights
from verl_traj.core.errors import check_positive_number
from verl_traj.core.plan.loss_weights import compute_loss_weights_from_counts
from verl_traj.integration.config.access import (CURRENT_POLICY_SEQUENCE_RATIOS, parameter_sync_step,
                                                 prompts_per_update, uses_critic)
from verl_traj.integration.config.verl_config import PlanSettings, prepare_config

__all__ = ["LossSpec", "UpdateSpec", "has_multi_row_trajectory"]


@dataclass(frozen=True)
class LossSpec:
    """One model's loss aggregation: the ``loss_weight`` mode, ``S`` of ``seq-mean-token-sum-norm`` and how many of the
    plan's (actor) mini-batches one of its optimizer steps takes (``union``: the critic may step on unions)."""

    mode: str
    scale: Optional[float]  # None: the batch's response width (core default; only where the config has no length)
    union: int = 1

    def weights(self, response_mask: torch.Tensor, mini_batch_id: torch.Tensor, traj_index: torch.Tensor,
                is_padding: torch.Tensor, copies: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[B]`` float32 ``loss_weight`` of every planned row (:func:`~verl_traj.core.compute_loss_weights`),
        normalised over each optimizer step's rows (``mini_batch_id // union``). ``copies`` ``[B, R]``
        (``traj.branch_weighting=expanded``): each loss token counts as its root-to-leaf paths."""
        if copies is not None:
            counts = ((response_mask != 0) * copies.to(torch.float64)).sum(-1).round().long()
            return compute_loss_weights_from_counts(
                self.mode, counts, torch.div(mini_batch_id, self.union, rounding_mode="floor"), traj_index,
                is_padding.bool(), loss_scale_factor=self.scale if self.scale is not None else response_mask.shape[1])
        return compute_loss_weights(self.mode, response_mask, torch.div(mini_batch_id, self.union, rounding_mode="floor"),
                                    traj_index, is_padding.bool(), loss_scale_factor=self.scale)

    def weights_from_counts(self, loss_tokens: torch.Tensor, mini_batch_id: torch.Tensor, traj_index: torch.Tensor,
                            is_padding: torch.Tensor) -> torch.Tensor:
        """:meth:`weights` from each row's loss-token count ``[B]`` instead of the ``[B, R]`` mask
        (:func:`~verl_traj.core.plan.loss_weights.compute_loss_weights_from_counts`; v1's driver keeps only the counts).
        Needs :attr:`scale`: no mask, no response width to fall back to."""
        if self.scale is None:
            raise TrajConfigError(
                "the loss weights from loss-token counts need the constant S of seq-mean-token-sum-norm, and the config "
                "gives none. Fix: set data.max_response_length (verl's default is 512), or loss_scale_factor in the "
                "actor / critic section.", field="data.max_response_length")
        return compute_loss_weights_from_counts(
            self.mode, loss_tokens, torch.div(mini_batch_id, self.union, rounding_mode="floor"), traj_index,
            is_padding.bool(), loss_scale_factor=self.scale)


def _loss_spec(section: Any, name: str, override: Optional[str], max_response_length: int, union: int = 1) -> LossSpec:
    mode = str(override or section.get("loss_agg_mode", "token-mean"))
    scale = section.get("loss_scale_factor", None)
    if scale is not None:
        return LossSpec(mode, check_positive_number(
            f"{name}.loss_scale_factor", scale, f"set {name}.loss_scale_factor to a positive number (the constant S of "
            "seq-mean-token-sum-norm) or null for data.max_response_length", error=TrajConfigError), union)
    return LossSpec(mode, float(max_response_length) if max_response_length > 0 else None, union)


@dataclass(frozen=True)
class UpdateSpec:
    """Every fact of an update both trainers read (module docstring); built by :meth:`prepare` at start-up."""

    traj_config: TrajConfig
    plan: Optional[PlanSettings]  # None: no micro-batch cap (unit tests of the planning pieces)
    prompts_per_update: int
    num_mini_batches: int
    epochs: int
    parameter_sync_step: int
    actor_loss: LossSpec
    critic_loss: Optional[LossSpec]  # None without a critic
    trajectory_ratios: bool = False  # step rows at traj.ratio_scope=trajectory: rollout correction per trajectory
    ratio_groups: bool = False  # ... and GSPO: the actor's rows carry ratio_group (its ratio over the trajectory)
    # the trainer's later local updates of a sync cycle reuse its first's old log-probs (v1 separate_async)
    reuses_old_log_probs: bool = False

    @property
    def critic_union(self) -> int:
        """Actor mini-batches per critic optimizer step (the critic's :attr:`LossSpec.union`; 1 without a critic)."""
        return self.critic_loss.union if self.critic_loss is not None else 1

    @classmethod
    def prepare(cls, config: Any, traj_config: TrajConfig) -> "UpdateSpec":
        """Adapt verl's config (:func:`prepare_config`; start-up validated it:
        :func:`~verl_traj.integration.startup.checks.check_startup`), then derive the spec."""
        return cls.derive(config, traj_config, prepare_config(config, traj_config))

    @classmethod
    def derive(cls, config: Any, traj_config: TrajConfig, plan: Optional[PlanSettings]) -> "UpdateSpec":
        """The spec of an already prepared (and validated) ``config``; changes nothing in it."""
        actor = config.actor_rollout_ref.actor
        prompts = prompts_per_update(config)
        mini = int(actor.ppo_mini_batch_size)
        max_response = int(config.data.get("max_response_length", 0) or 0)
        critic = config.get("critic", None) if uses_critic(config) else None
        critic_mini = int(critic.get("ppo_mini_batch_size", 0) or mini) if critic is not None else mini
        union = (prompts // mini) // max(prompts // critic_mini, 1)
        trajectory_ratios = traj_config.step_wise and traj_config.ratio_scope == "trajectory"
        return cls(
            traj_config=traj_config, plan=plan, prompts_per_update=prompts, num_mini_batches=prompts // mini,
            epochs=int(actor.get("ppo_epochs", 1) or 1), parameter_sync_step=parameter_sync_step(config),
            actor_loss=_loss_spec(actor, "actor_rollout_ref.actor", traj_config.loss_agg_mode, max_response),
            critic_loss=(_loss_spec(critic, "critic", traj_config.critic_loss_agg_mode, max_response, union)
                         if critic is not None else None),
            trajectory_ratios=trajectory_ratios,
            ratio_groups=(trajectory_ratios and (actor.get("policy_loss", None) or {}).get("loss_mode", "vanilla")
                          in CURRENT_POLICY_SEQUENCE_RATIOS),
        )

    def plan_seed(self, global_step: int, local_step: int = 0) -> int:
        """The planner's seed of one update: ``traj.seed`` + its index among all local updates (v1 runs
        ``parameter_sync_step`` local updates per global step; v0 one)."""
        return self.traj_config.seed + int(global_step) * self.parameter_sync_step + int(local_step)


def has_multi_row_trajectory(traj_index: torch.Tensor, is_padding: torch.Tensor) -> bool:
    """Whether some trajectory has several real rows (``[B]`` each): the only case in which a row's sequence ratio
    differs from its trajectory's, so the only one in which the actor's rows carry ``ratio_group``."""
    real = traj_index[~is_padding.bool()]
    return bool(real.numel() and torch.unique(real).numel() < real.numel())
