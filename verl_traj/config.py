"""The ``traj:`` configuration section: every knob verl_traj adds, validated at start-up.

Read once, on the driver, before any worker starts; each error names the field, the value and what to
change, with one error class (:class:`TrajConfigError`). No verl import: the checks read verl's
sections as plain mappings. The choices are the core's own names (one place each): the loss
aggregation modes are the core's registry (:func:`verl_traj.core.loss_weights.loss_weight_modes`).

Defaults are the right ones for multi-turn data: trajectory-aware mini-batches on, whole GRPO groups
kept in one mini-batch, DP balancing on. ``traj.enable=false`` gives stock verl behaviour (the
side-by-side comparison is that one override).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

from verl_traj.core.balancing import WORKLOAD_MODELS
from verl_traj.core.errors import TrajInputError
from verl_traj.core.estimators import step_row_refusal
from verl_traj.core.keys import IS_LAST_STEP, PLAN_KEYS
from verl_traj.core.loss_weights import loss_weight_modes
from verl_traj.core.planning import GROUP_BY_CHOICES, MINI_BATCH_BALANCE_CHOICES
from verl_traj.stepwise.ratios import RATIO_SCOPES

__all__ = [
    "GROUP_BY_CHOICES",
    "MINI_BATCH_BALANCE_CHOICES",
    "PADDED_CAP_CHOICES",
    "SUPPORTED_POLICY_LOSS_MODES",
    "TrajConfig",
    "TrajConfigError",
    "validate_against_verl",
]

# verl 0.9.1 policy loss fns that multiply the per-token loss by ``rollout_is_weights`` and then call
# ``agg_loss(pg_losses, response_mask, loss_agg_mode, **config.global_batch_info)``: exact with per-row
# weights. Not supported: "sapo" (hard-codes seq-mean-token-mean), "geo_mean" (sequence-level geometric
# mean, uses rollout_is_weights in log space), "bypass_mode" (recomputes its own IS weights).
# traj.padded_cap: what the micro-batch cap bounds without remove-padding (core.packing cost "padded" / "padded_area")
PADDED_CAP_CHOICES = ("tokens", "area")
UNSUPPORTED_LOSS_REASONS = {  # why per-row weights cannot express what these verl 0.9.1 losses compute
    "sapo": " (sapo hard-codes seq-mean-token-mean aggregation inside the micro-batch)",
    "geo_mean": " (geo_mean takes a per-row geometric mean of the ratios inside the micro-batch and uses the IS "
                "weights in log space, so neither a global normaliser nor a trajectory-wide mean is a per-row weight)",
    "bypass_mode": " (bypass_mode recomputes its own IS weights per micro-batch and drops the given ones)",
}
SUPPORTED_POLICY_LOSS_MODES = ("vanilla", "dppo_tv", "dppo_kl", "gspo", "gpg", "clip_cov", "kl_cov", "dro", "cispo")


class TrajConfigError(TrajInputError):
    """A ``traj:`` (or related verl) setting is invalid; the message says which and how to fix it
    (``field``: the setting, e.g. ``"traj.enable"``, where the raise names one)."""


@dataclass(frozen=True)
class TrajConfig:
    """Validated ``traj:`` section.

    Attributes:
        enable: master switch. ``False`` = stock verl mini-batching, balancing and loss aggregation.
        group_by: the unit never split across mini-batches: ``"trajectory"`` (all step rows of one
            trajectory) or ``"group"`` (every trajectory sharing one GRPO ``uid``).
        mini_batch_balance: ``"tokens"``: mini-batches of equal token mass (prompts per optimizer step
            may vary); ``"units"``: every mini-batch gets the same number of units (+-1), i.e. a fixed
            prompt count per optimizer step, tokens balanced among those.
        balance_dp: balance each mini-batch's rows over DP ranks by workload (equal row counts).
        workload: per-row cost model for DP balancing: ``"verl"`` (verl's ``calculate_workload``) or
            ``"tokens"``.
        micro_batch_max_tokens: tokens per GPU in one micro-batch of the actor / critic update (verl's
            ``ppo_max_token_len_per_gpu`` meaning: the per-SP-group cap is this times the Ulysses size);
            ``None`` derives it from verl's own settings. The plan's micro-batches are what runs.
        infer_micro_batch_max_tokens: the same for the log-prob / reference / value passes; ``None``
            keeps verl's own log-prob caps.
        padded_cap: without remove-padding (every micro-batch padded to its longest row), what the cap
            bounds: ``"tokens"``, the rows' token sum as in verl (from verl's number of passes up, padding
            weighed against ``pass_cost_tokens``), or ``"area"``, rows x longest row (a strict bound on the padded activation
            memory; more, smaller passes). With remove-padding the cap always bounds tokens.
        pass_cost_tokens: with ``padded_cap="tokens"`` and no remove-padding: the fixed cost of one forward /
            backward pass, in padded positions. From verl's count upward, the planner cuts another micro-batch
            only where the padded positions it saves exceed this. ``None``: never more passes than the fewest.
        loss_agg_mode: loss aggregation for policy, entropy and KL losses; ``None`` uses
            ``actor_rollout_ref.actor.loss_agg_mode``. Adds ``"traj-mean"``.
        critic_loss_agg_mode: the same for the value loss; ``None`` uses ``critic.loss_agg_mode``.
        traj_id_key / step_index_key: ``non_tensor_batch`` fields carrying each row's trajectory id and
            step index (step-wise rows). Absent fields = one row per trajectory.
        step_wise: rollouts arrive as one row per LLM call (turn) from the step-wise agent loop.
        merge_prefix: with ``step_wise``, merge consecutive turns whose context is a token prefix of the
            next turn's context into one row.
        seed: planner seed (mini-batch assignment tie-breaks); the per-step seed is ``seed + step``.
        ratio_scope: what verl's sequence-level off-policy quantities (``algorithm.rollout_correction``: the
            ``rollout_is=sequence`` weight, ``seq_*`` rejection, the per-sequence diagnostics) are computed over with
            step rows: ``"trajectory"`` (all loss tokens of the trajectory, applied to every row of it) or ``"row"``
            (verl's: each step row alone).
    """

    enable: bool = True
    group_by: str = "group"
    mini_batch_balance: str = "tokens"
    balance_dp: bool = True
    workload: str = "verl"
    micro_batch_max_tokens: Optional[int] = None
    infer_micro_batch_max_tokens: Optional[int] = None
    padded_cap: str = "tokens"
    pass_cost_tokens: Optional[int] = 1024
    loss_agg_mode: Optional[str] = None
    critic_loss_agg_mode: Optional[str] = None
    traj_id_key: str = "traj_id"
    step_index_key: str = "step_index"
    step_wise: bool = False
    merge_prefix: bool = True
    seed: int = 0
    ratio_scope: str = "trajectory"

    def __post_init__(self) -> None:
        for name in _BOOL_FIELDS:
            _check_bool(f"traj.{name}", getattr(self, name))
        _check_choice("traj.group_by", self.group_by, GROUP_BY_CHOICES)
        _check_choice("traj.mini_batch_balance", self.mini_batch_balance, MINI_BATCH_BALANCE_CHOICES)
        _check_choice("traj.workload", self.workload, WORKLOAD_MODELS)
        _check_choice("traj.padded_cap", self.padded_cap, PADDED_CAP_CHOICES)
        _check_choice("traj.ratio_scope", self.ratio_scope, RATIO_SCOPES)
        for name in ("loss_agg_mode", "critic_loss_agg_mode"):
            if getattr(self, name) is not None:
                _check_choice(f"traj.{name}", getattr(self, name), loss_weight_modes())
        for name in ("micro_batch_max_tokens", "infer_micro_batch_max_tokens"):
            cap = getattr(self, name)
            if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
                raise TrajConfigError(
                    f"traj.{name}={cap!r} is invalid: set a positive integer number of tokens per micro-batch "
                    "per GPU (at least the longest prompt+response), or null to derive it from verl's settings.",
                    field=f"traj.{name}",
                )
        cost = self.pass_cost_tokens
        if cost is not None and (isinstance(cost, bool) or not isinstance(cost, int) or cost < 0):
            raise TrajConfigError(
                f"traj.pass_cost_tokens={cost!r} is invalid: set the fixed cost of one forward/backward pass as a "
                "non-negative number of padded positions (default 1024), or null for the fewest passes.",
                field="traj.pass_cost_tokens",
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise TrajConfigError(
                f"traj.seed={self.seed!r} is invalid: the planner seeds numpy with seed + training step, which needs "
                "a non-negative int. Fix: set traj.seed to an integer >= 0 (default 0).", field="traj.seed",
            )
        self._check_keys()

    def _check_keys(self) -> None:
        """``traj_id_key`` / ``step_index_key``: two distinct non-empty names, none a field the plan writes."""
        for name in ("traj_id_key", "step_index_key"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise TrajConfigError(f"traj.{name}={value!r} must be a non-empty field name.", field=f"traj.{name}")
            if value in PLAN_KEYS or value == IS_LAST_STEP:
                raise TrajConfigError(
                    f"traj.{name}={value!r} is a field verl_traj writes itself ({list(PLAN_KEYS) + [IS_LAST_STEP]}): "
                    f"the plan would overwrite it. Fix: set traj.{name} to the non_tensor_batch field your agent "
                    f"loop writes (default {'traj_id' if name == 'traj_id_key' else 'step_index'!r}).",
                    field=f"traj.{name}",
                )
        if self.traj_id_key == self.step_index_key:
            raise TrajConfigError(
                f"traj.traj_id_key and traj.step_index_key are both {self.traj_id_key!r}: one field cannot carry both "
                "the trajectory id and the step index. Fix: give them two different non_tensor_batch fields "
                "(defaults 'traj_id' and 'step_index').", field="traj.step_index_key",
            )

    @classmethod
    def from_mapping(cls, section: Optional[Mapping[str, Any]]) -> "TrajConfig":
        """Build from the ``traj:`` mapping (dict or OmegaConf node); unknown keys are an error."""
        if section is None:
            return cls()
        if isinstance(section, bool):
            raise TrajConfigError(
                f"traj={section!r} sets the whole traj section to a bool, not a mapping of settings. Fix: write "
                f"traj.enable={str(section).lower()} (the switch lives inside the section).", field="traj",
            )
        if not hasattr(section, "items"):
            raise TrajConfigError(
                f"traj={section!r} is a {type(section).__name__}, not a mapping of settings. Fix: give traj: as a "
                "mapping (traj.enable=true, traj.group_by=group, ...) or leave it out for the defaults.", field="traj",
            )
        data = dict(section.items())
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in set(data) - known)
        if unknown:
            raise TrajConfigError(
                f"unknown key(s) in traj: {unknown}. Valid keys: {sorted(known)}. "
                "Check the spelling in your overrides (e.g. traj.micro_batch_max_tokens=8192).", field="traj",
            )
        return cls(**data)

    @classmethod
    def of(cls, config: Any) -> "TrajConfig":
        """The ``traj:`` section of verl's whole config, parsed once per config object (agent loops run per
        trajectory and read it there; the cache holds the config weakly)."""
        try:
            return _PARSED[config]
        except (KeyError, TypeError):
            parsed = cls.from_mapping(config.get("traj") if config is not None else None)
        try:
            _PARSED[config] = parsed
        except TypeError:  # not weak-referenceable (a plain dict): parse each time
            pass
        return parsed


_PARSED: "weakref.WeakKeyDictionary[Any, TrajConfig]" = weakref.WeakKeyDictionary()


# traj.* fields that must be real bools: a string "false" is truthy, and None skips every check keyed on them.
_BOOL_FIELDS = tuple(f.name for f in fields(TrajConfig) if f.type == "bool")  # the annotation (a string here)


def _check_bool(field: str, value: Any) -> None:
    if isinstance(value, bool):
        return
    why = ("null leaves it neither on nor off (every start-up check keyed on it would be skipped)" if value is None
           else f"a {type(value).__name__} is not a bool" + (" (any non-empty string is truthy: the feature would "
                                                              "stay on)" if isinstance(value, str) else ""))
    raise TrajConfigError(
        f"{field}={value!r} is invalid: {why}. Fix: set {field}=true or {field}=false (an unquoted YAML boolean), "
        "or leave it out for the default.", field=field,
    )


def _check_choice(field: str, value: Any, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise TrajConfigError(f"{field}={value!r} is not one of {list(choices)}; set {field} to one of them.",
                              field=field)


def _get(node: Any, path: str, default: Any = None) -> Any:
    """``a.b.c`` from nested mappings / objects; ``default`` where a level is missing or None."""
    for key in path.split("."):
        if node is None:
            return default
        node = node.get(key, None) if hasattr(node, "get") else getattr(node, key, None)
    return default if node is None else node


def uses_critic(config: Any) -> bool:
    """verl's ``need_critic`` (``verl/trainer/ppo/utils.py``) on plain mappings, without its warning:
    ``critic.enable`` where set, else on exactly for ``algorithm.adv_estimator=gae`` (verl's default is null)."""
    enable = _get(config, "critic.enable", None)
    if enable is not None:
        return bool(enable)
    return _get(config, "algorithm.adv_estimator", None) == "gae"


def validate_against_verl(traj_config: TrajConfig, config: Any) -> None:
    """Cross-check ``traj:`` against verl's own sections (an OmegaConf/dict-like ``config``).

    Raises ``TrajConfigError`` naming the field, the value and the fix."""
    if not traj_config.enable:
        _check_stock_step_rows(traj_config, config)
        return
    _check_estimator(traj_config, config)
    _check_v1_row_fields(traj_config, config)
    _check_policy_loss(config)
    _check_mini_batches(config)
    _check_token_caps(traj_config, config)


def _check_stock_step_rows(traj_config: TrajConfig, config: Any) -> None:
    """``traj.step_wise=true`` with ``traj.enable=false`` is stock verl on step rows (one row per LLM call, trained
    by verl's own mini-batches, for a side-by-side run): only v1 stores an agent loop's several outputs as rows."""
    if traj_config.step_wise and not bool(_get(config, "trainer.use_v1", False)):
        raise TrajConfigError(
            "traj.step_wise=true with traj.enable=false (stock verl on step rows) needs the v1 trainer: v0 has no "
            "step rows of its own. Set trainer.use_v1=true, or traj.enable=true (verl_traj's step rows, v0 and v1), "
            "or traj.step_wise=false.", field="traj.step_wise")


def _check_estimator(traj_config: TrajConfig, config: Any) -> None:
    """Step rows take the estimators :func:`~verl_traj.core.estimators.step_row_refusal` allows: the question the
    step-wise advantage path asks at run time, so start-up and run time cannot disagree."""
    reason = step_row_refusal(str(_get(config, "algorithm.adv_estimator", "grpo"))) if traj_config.step_wise else ""
    if reason:
        raise TrajConfigError(reason, field="algorithm.adv_estimator")
    if bool(_get(config, "algorithm.use_pf_ppo", False)):
        raise TrajConfigError(
            "algorithm.use_pf_ppo=true resamples rows after the advantage step, which would break the planned "
            "mini-batches (whole units, padding rows, per-row loss weights). Set algorithm.use_pf_ppo=false, or "
            "traj.enable=false.", field="algorithm.use_pf_ppo")


def _check_v1_row_fields(traj_config: TrajConfig, config: Any) -> None:
    """On v1 a row's trajectory and step are its TransferQueue key (``{uid}_{session}_{index}``), not batch fields:
    ``traj.traj_id_key`` / ``traj.step_index_key`` name v0's fields and would be ignored there."""
    if not bool(_get(config, "trainer.use_v1", False)):
        return
    defaults = {f.name: f.default for f in fields(TrajConfig)}
    for name in ("traj_id_key", "step_index_key"):
        if getattr(traj_config, name) != defaults[name]:
            raise TrajConfigError(
                f"traj.{name}={getattr(traj_config, name)!r} has no effect on the v1 trainer (trainer.use_v1=true): there a "
                "row's trajectory and step are read from its TransferQueue key {uid}_{session}_{index}, which verl's "
                f"agent-loop worker writes. Remove the traj.{name} override, or set trainer.use_v1=false to use "
                "the v0 trainer, which reads these non_tensor_batch fields.", field=f"traj.{name}")


# policy losses with a sequence ratio computed inside the actor's loss from the current policy: with step rows at
# traj.ratio_scope=trajectory the actor sums it over each trajectory's rows first (integration/workers.py)
CURRENT_POLICY_SEQUENCE_RATIOS = ("gspo",)


def _check_policy_loss(config: Any) -> None:
    mode = _get(config, "actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla")
    if mode not in SUPPORTED_POLICY_LOSS_MODES:
        raise TrajConfigError(
            f"actor_rollout_ref.actor.policy_loss.loss_mode={mode!r} is not supported with traj.enable=true: "
            "verl_traj folds the mini-batch-global loss normalisation (and, with step rows, the trajectory-scoped "
            "rollout correction) into per-token weights, which needs a policy loss fn that multiplies its token "
            f"losses by rollout_is_weights{UNSUPPORTED_LOSS_REASONS.get(mode, '')}. Use one of "
            f"{list(SUPPORTED_POLICY_LOSS_MODES)}, or set traj.enable=false.",
            field="actor_rollout_ref.actor.policy_loss.loss_mode",
        )
    if bool(_get(config, "algorithm.rollout_correction.bypass_mode", False)):
        raise TrajConfigError(
            "algorithm.rollout_correction.bypass_mode=true is not supported with traj.enable=true: verl then swaps the "
            "policy loss for its 'bypass_mode' loss, which computes its own IS weights per micro-batch and is not "
            "normalised over the mini-batch. Fix: set algorithm.rollout_correction.bypass_mode=false (old log-probs "
            "are recomputed and the driver corrects, per trajectory with traj.ratio_scope=trajectory), or "
            "traj.enable=false.", field="algorithm.rollout_correction.bypass_mode")
    if bool(_get(config, "actor_rollout_ref.actor.use_prefix_grouper", False)):
        raise TrajConfigError(
            "actor_rollout_ref.actor.use_prefix_grouper=true is not supported with traj.enable=true (it needs "
            "verl's group-contiguous balancing). Set one of them to false.",
            field="actor_rollout_ref.actor.use_prefix_grouper",
        )


def parameter_sync_step(config: Any) -> int:
    """Local updates per weight sync: 1 on v0; ``trainer.v1.<trainer_mode>.parameter_sync_step`` on v1."""
    if not bool(_get(config, "trainer.use_v1", False)):
        return 1
    mode = _get(config, "trainer.v1.trainer_mode", "sync")
    return int(_get(config, f"trainer.v1.{mode}.parameter_sync_step", 1) or 1)


def prompts_per_update(config: Any) -> int:
    """Prompts per planned update: ``train_batch_size``, divided by v1's ``parameter_sync_step``."""
    train_bs = int(_get(config, "data.train_batch_size", 0) or 0)
    sync = parameter_sync_step(config)
    if train_bs and train_bs % sync:
        mode = _get(config, "trainer.v1.trainer_mode", "sync")
        raise TrajConfigError(
            f"data.train_batch_size={train_bs} is not a multiple of trainer.v1.{mode}.parameter_sync_step={sync}: "
            "each local update samples train_batch_size / parameter_sync_step prompts. Make it a multiple."
        )
    return train_bs // sync


def _check_mini_batches(config: Any) -> None:
    """Whole optimizer steps: the prompts of an update (``train_batch_size``; on v1 divided by
    ``parameter_sync_step``) a multiple of the actor's (and critic's) mini-batch, and the critic's mini-batches
    unions of the actor's (so both step on whole planned units)."""
    train_bs = prompts_per_update(config)
    label = "data.train_batch_size" + ("" if parameter_sync_step(config) == 1 else " / parameter_sync_step")
    mini = int(_get(config, "actor_rollout_ref.actor.ppo_mini_batch_size", 0) or 0)
    if train_bs and (mini <= 0 or train_bs % mini):
        raise TrajConfigError(
            f"{label}={train_bs} is not a multiple of actor_rollout_ref.actor.ppo_mini_batch_size="
            f"{mini}: the number of mini-batches (optimizer steps per training step) must be whole. "
            "Make train_batch_size a multiple of ppo_mini_batch_size.",
            field="actor_rollout_ref.actor.ppo_mini_batch_size",
        )
    if not uses_critic(config) or not train_bs:
        return
    critic_mini = int(_get(config, "critic.ppo_mini_batch_size", mini) or mini)
    m_actor, ok = train_bs // mini, critic_mini > 0 and train_bs % critic_mini == 0
    if not ok or m_actor % (train_bs // critic_mini):
        raise TrajConfigError(
            f"critic.ppo_mini_batch_size={critic_mini} does not fit the actor's plan: with {label}="
            f"{train_bs} and actor_rollout_ref.actor.ppo_mini_batch_size={mini} the actor steps {m_actor} "
            "mini-batches of whole units, and each critic mini-batch must be a union of whole actor mini-batches. "
            f"Set critic.ppo_mini_batch_size to a multiple of {mini} that divides {train_bs} (e.g. {mini}).",
            field="critic.ppo_mini_batch_size",
        )


def ulysses_size(section: Any) -> int:
    """Ulysses size the engine of an actor / critic section runs with: the engine config's
    (``fsdp_config`` / ``fsdp``), where verl copies the actor's deprecated top-level key when it is > 1."""
    engine = section.get("fsdp_config", None) or section.get("fsdp", None) or {}
    legacy = int(section.get("ulysses_sequence_parallel_size", 1) or 1)
    if "fsdp" not in section and legacy > 1:  # the actor (verl copies it into fsdp_config); the critic ignores it
        return legacy
    return int(engine.get("ulysses_sequence_parallel_size", 1) or 1)


def _check_token_caps(traj_config: TrajConfig, config: Any) -> None:
    """An explicit training cap must hold a full-length row (per SP group: cap x Ulysses size)."""
    cap = traj_config.micro_batch_max_tokens
    if cap is None or (traj_config.step_wise and traj_config.merge_prefix):
        return  # derived caps are raised to the longest row; merged rows are checked per batch by the planner
    max_len = int(_get(config, "data.max_prompt_length", 0) or 0) + int(_get(config, "data.max_response_length", 0) or 0)
    sp = ulysses_size(_get(config, "actor_rollout_ref.actor", {}))
    if max_len and cap * sp < max_len:
        need = -(-max_len // sp)
        raise TrajConfigError(
            f"traj.micro_batch_max_tokens={cap} (x ulysses_sequence_parallel_size={sp} = {cap * sp} tokens per "
            f"sequence-parallel group) is below data.max_prompt_length + data.max_response_length = {max_len}: "
            f"a full-length row could not fit in any micro-batch. Raise traj.micro_batch_max_tokens to at least {need}."
        )
