"""The ``traj:`` configuration section: every knob verl_traj adds, validated at start-up.

Pure module (no torch, no Ray, no verl imports) so it can be validated anywhere, including on
the driver before any worker starts. Each error names the field, the value and what to change.

Defaults are the right ones for multi-turn data: trajectory-aware mini-batches on, whole GRPO
groups kept in one mini-batch, DP balancing on. ``traj.enable=false`` gives stock verl behaviour
(the side-by-side comparison is that one override).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

GROUP_BY_CHOICES = ("trajectory", "group")
WORKLOAD_CHOICES = ("verl", "tokens")
LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
    "traj-mean",
)
# Advantage estimators that are per-token / temporal: they cannot be computed per trajectory and
# broadcast to step rows (no cross-step credit on step-wise rows).
TEMPORAL_ADV_ESTIMATORS = ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


class TrajConfigError(ValueError):
    """A ``traj:`` (or related verl) setting is invalid; the message says which and how to fix it."""


@dataclass(frozen=True)
class TrajConfig:
    """Validated ``traj:`` section.

    Attributes:
        enable: master switch. ``False`` = stock verl mini-batching, balancing and loss aggregation.
        group_by: the unit that is never split across mini-batches: ``"trajectory"`` (all step rows
            of one trajectory) or ``"group"`` (every trajectory sharing one GRPO ``uid``).
        balance_dp: balance each mini-batch's rows over DP ranks by workload (equal row counts).
        workload: per-row cost model for DP balancing: ``"verl"`` (verl's attention-aware
            ``calculate_workload``) or ``"tokens"`` (plain token count).
        micro_batch_max_tokens: hard cap on tokens (prompt+response) in one micro-batch on one rank;
            ``None`` keeps verl's own micro-batching settings.
        loss_agg_mode: loss aggregation for policy, entropy and KL losses; ``None`` uses
            ``actor_rollout_ref.actor.loss_agg_mode``. Adds ``"traj-mean"``.
        critic_loss_agg_mode: the same for the value loss; ``None`` uses ``critic.loss_agg_mode``.
        traj_id_key / step_index_key: ``non_tensor_batch`` fields carrying each row's trajectory
            id and step index (step-wise multi-turn rows). Absent fields = one row per trajectory.
        step_wise: rollouts arrive as one row per LLM call (turn) from the step-wise agent loop.
        merge_prefix: with ``step_wise``, merge consecutive turns whose context is a token prefix
            of the next turn's context into one row.
        seed: planner seed (mini-batch assignment tie-breaks and per-epoch shuffles).
    """

    enable: bool = True
    group_by: str = "group"
    balance_dp: bool = True
    workload: str = "verl"
    micro_batch_max_tokens: Optional[int] = None
    loss_agg_mode: Optional[str] = None
    critic_loss_agg_mode: Optional[str] = None
    traj_id_key: str = "traj_id"
    step_index_key: str = "step_index"
    step_wise: bool = False
    merge_prefix: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        _check_choice("traj.group_by", self.group_by, GROUP_BY_CHOICES)
        _check_choice("traj.workload", self.workload, WORKLOAD_CHOICES)
        for name in ("loss_agg_mode", "critic_loss_agg_mode"):
            value = getattr(self, name)
            if value is not None:
                _check_choice(f"traj.{name}", value, LOSS_AGG_MODES)
        cap = self.micro_batch_max_tokens
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
            raise TrajConfigError(
                f"traj.micro_batch_max_tokens={cap!r} is invalid: set a positive integer number of tokens "
                "per micro-batch per rank (at least the longest prompt+response), or null to keep verl's "
                "micro-batching."
            )
        for name in ("traj_id_key", "step_index_key"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise TrajConfigError(f"traj.{name}={getattr(self, name)!r} must be a non-empty field name.")
        if self.step_wise and not self.enable:
            raise TrajConfigError(
                "traj.step_wise=true needs traj.enable=true: step rows of one trajectory must stay in one "
                "mini-batch. Set traj.enable=true or traj.step_wise=false."
            )

    @classmethod
    def from_mapping(cls, section: Optional[Mapping[str, Any]]) -> "TrajConfig":
        """Build from the ``traj:`` mapping (dict or OmegaConf node); unknown keys are an error."""
        if section is None:
            return cls()
        data = dict(section.items()) if hasattr(section, "items") else dict(section)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise TrajConfigError(
                f"unknown key(s) in traj: {unknown}. Valid keys: {sorted(known)}. "
                "Check the spelling in your overrides (e.g. traj.micro_batch_max_tokens=8192)."
            )
        return cls(**data)


def _check_choice(field: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise TrajConfigError(f"{field}={value!r} is not one of {list(choices)}; set {field} to one of them.")


def validate_against_verl(traj: TrajConfig, config: Any) -> None:
    """Cross-check ``traj:`` against verl's own sections (an OmegaConf/dict-like ``config``).

    Raises ``TrajConfigError`` naming the field, the value and the fix.
    """
    if not traj.enable:
        return
    algorithm = _get(config, "algorithm", {}) or {}
    adv = str(_get(algorithm, "adv_estimator", "grpo"))
    if traj.step_wise and adv in TEMPORAL_ADV_ESTIMATORS:
        raise TrajConfigError(
            f"algorithm.adv_estimator={adv!r} cannot be used with traj.step_wise=true: it is a per-token, "
            "temporal estimator, and step rows carry no cross-step credit path (earlier turns would get "
            "advantages computed on their own truncated sequence). Use an outcome estimator "
            "(algorithm.adv_estimator=grpo, rloo, opo, grpo_passk, ...) or set traj.step_wise=false "
            "to train each trajectory as one concatenated row."
        )
    trainer = _get(config, "trainer", {}) or {}
    if bool(_get(trainer, "use_v1", False)):
        raise TrajConfigError(
            "trainer.use_v1=true is not supported by verl_traj: its trainer subclasses verl's "
            "RayPPOTrainer (the v0 trainer). Set trainer.use_v1=false (the verl_traj configs do)."
        )
    cap = traj.micro_batch_max_tokens
    if cap is not None:
        data = _get(config, "data", {}) or {}
        max_len = int(_get(data, "max_prompt_length", 0) or 0) + int(_get(data, "max_response_length", 0) or 0)
        if traj.merge_prefix and traj.step_wise:
            pass  # merged rows can exceed prompt+response budgets; checked per batch by the planner
        elif max_len and cap < max_len:
            raise TrajConfigError(
                f"traj.micro_batch_max_tokens={cap} is below data.max_prompt_length + data.max_response_length"
                f" = {max_len}: a full-length row could not fit in any micro-batch. Raise "
                f"traj.micro_batch_max_tokens to at least {max_len}."
            )


def _get(node: Any, key: str, default: Any = None) -> Any:
    if node is None:
        return default
    if hasattr(node, "get"):
        value = node.get(key, default)
        return default if value is None and default is not None else value
    return getattr(node, key, default)
