"""The ``traj:`` configuration section: every knob verl_traj adds, validated when it is read.

:class:`TrajConfig` checks its own fields (types, choices, ranges), each error naming the field, the value and
the fix, with one error class (:class:`TrajConfigError`). Checks of ``traj:`` against verl's own sections are
:mod:`verl_traj.integration.startup.verl_checks`; everything the driver checks before training starts runs once, in
:func:`verl_traj.integration.startup.checks.check_startup`. Pure module (no verl import). The choices are the core's own
names (one place each): the loss aggregation modes are the core's registry
(:func:`verl_traj.core.plan.loss_weights.loss_weight_modes`).

Defaults are the right ones for multi-turn data: trajectory-aware mini-batches on, whole GRPO groups
kept in one mini-batch, DP balancing on. ``traj.enable=false`` gives stock verl behaviour (the
side-by-side comparison is that one override).
"""

from __future__ import annotations

import difflib
import functools
import weakref
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional, Union

from verl_traj.core.packing.balancing import WORKLOAD_MODELS
from verl_traj.core.errors import TrajInputError, check_choice
from verl_traj.core.plan.estimators import BRANCH_WEIGHTINGS, STEP_GROUP_BASELINES
from verl_traj.core.rollout.failures import FAILED_GROUP_POLICIES
from verl_traj.core.keys import IS_LAST_STEP, PLAN_KEYS
from verl_traj.core.plan.loss_weights import loss_weight_modes
from verl_traj.core.plan.planning import GROUP_BY_CHOICES, MINI_BATCH_BALANCE_CHOICES
from verl_traj.core.rollout.offpolicy import FALLBACKS, HealthThresholds
from verl_traj.core.rollout.staleness import STALE_GROUP_POLICIES, check_bound
from verl_traj.stepwise.ratios import RATIO_SCOPES

__all__ = ["DEFAULT_MAX_LAG", "GROUP_BY_CHOICES", "MINI_BATCH_BALANCE_CHOICES", "PADDED_CAP_CHOICES", "TrajConfig",
           "TrajConfigError"]

# traj.max_lag under stale_groups=correct when unset: chosen by scripts/bench_async_bias.py (docs/trainers.md)
DEFAULT_MAX_LAG = 8

# traj.padded_cap: what the micro-batch cap bounds without remove-padding (core.plan.packing cost "padded" / "padded_area")
PADDED_CAP_CHOICES = ("tokens", "area")


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
            weighed against ``pass_cost_tokens``), or ``"area"``, rows x longest row (a strict bound on the padded
            activation memory; more, smaller passes). With remove-padding the cap always bounds tokens.
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
            step rows: ``"row"`` (verl's: each step row alone; the default) or ``"trajectory"`` (all loss tokens of
            the trajectory, applied to every row of it; GSPO's ratio too); the default by
            ``scripts/bench_ratio_scope.py`` (docs/stepwise.md).
        prefix_tree: forward each micro-batch's rows as one prefix tree (every shared prefix once) in every pass;
            ``"auto"`` (default): where exact and served, settled to ``true`` / ``false`` at start-up, said
            (docs/prefix_tree.md); ``true`` refuses what cannot serve it; read :attr:`trees`.
        tree_token_cost / tree_margin: with trees, each micro-batch forwards as a tree only where the tree is predicted
            cheaper than its rows by ``tree_margin`` (:mod:`verl_traj.core.trees.tree_cost`: ``tree_token_cost`` is a
            tree token's cost in row tokens; ``None``: the device's measured figure).
        failed_groups: v1: what happens to a GRPO group in which a rollout failed (its agent loop raised or timed out):
            ``"drop"`` (default: the whole group leaves the batch, a fresh prompt replaces it) or ``"keep_survivors"``
            (train the finished sessions, the baseline over them; a group with none is dropped).
            :mod:`verl_traj.core.rollout.failures`.
        trajectory_timeout_s: v1: seconds one session (trajectory) may run, tools and generation included, before it
            fails with reason ``timeout`` (then ``failed_groups`` applies); ``None``: no deadline.
        replay_poll_s: v1: seconds between the trainer's checks that the step's groups are done (verl's replay buffer
            ``poll_interval``, 2.0 in verl and not in its config: generation then ends on a 2-second tick).
        max_staleness: v1 async modes: the most a trajectory's token staleness may be when it trains (the
            token-weighted mean of how many policy versions each generated token is behind the trained policy);
            ``None``: no bound. :mod:`verl_traj.core.rollout.staleness`.
        stale_groups: what the bound does with a group that has a trajectory over it: ``"drop"`` (default: the whole
            group leaves, a fresh prompt replaces it), ``"defer"`` (the trainer waits for running groups that would
            pass it at the next step; a finished group over it anyway is dropped) or ``"correct"`` (it trains, its
            stale tokens under verl's rollout correction, which start-up requires, as long as no token of it is more
            than ``max_lag`` versions old and the weights stay healthy; else ``correct_fallback`` applies).
        max_lag: the hard cap on every trained token's lag (policy versions between the one that sampled it and the
            one trained), over which a group gets the ``stale_groups`` policy (``correct``: ``correct_fallback``).
            ``None``: none, except under ``correct``, which caps at :data:`DEFAULT_MAX_LAG` (:attr:`lag_cap`).
            :mod:`verl_traj.core.rollout.offpolicy`.
        correct_fallback: ``correct``: what a group past ``max_lag``, or over ``max_staleness`` while the weights are
            unhealthy, gets: ``"defer"`` (default: waited for, no length bias) or ``"drop"``.
        offpolicy_min_ess / offpolicy_max_log_ratio_m2: ``correct``: the ESS of the off-policy tokens' truncated
            weights below which (0.3, where verl's docs warn), or their mean squared log-ratio above which (0.04,
            M2PO's bound), the fallback takes over (:attr:`health_thresholds`; docs/trainers.md).
        step_advantage_weight: ``algorithm.adv_estimator=gigpo``: GiGPO's omega, the weight of the step-level advantage
            added to the episode-level one (``>= 0``; 0 is GRPO on step rows). :mod:`verl_traj.stepwise.step_groups`.
        step_group_baseline: ``gigpo``: a step group's baseline: ``"gigpo"`` (the paper's mean and std, default) or
            ``"leave_one_out"`` (the others' mean, no std: unbiased where the anchor key is the state).
        branch_weighting: a branching session's call on ``m`` root-to-leaf paths trains ``"once"`` (default: each path's
            copy weighted ``1 / m``), ``"expanded"`` (as ``m`` rows would) or ``"paths"`` (as ``m`` rows). docs/branching.md.
        credit_rule_modules: dotted names of modules that register per-call credit rules
            (:func:`verl_traj.stepwise.credit_rules.register_credit_rule`), imported in every process that needs them
            (start-up, the trainer, the agent-loop workers); a rule's name is then an ``algorithm.adv_estimator``.
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
    ratio_scope: str = "row"
    prefix_tree: Union[bool, str] = "auto"
    tree_token_cost: Optional[float] = None
    tree_margin: float = 0.1
    failed_groups: str = "drop"
    trajectory_timeout_s: Optional[float] = None
    replay_poll_s: float = 2.0
    max_staleness: Optional[float] = None
    stale_groups: str = "drop"
    max_lag: Optional[int] = None
    correct_fallback: str = "defer"
    offpolicy_min_ess: float = 0.3
    offpolicy_max_log_ratio_m2: float = 0.04
    step_advantage_weight: float = 1.0
    step_group_baseline: str = "gigpo"
    branch_weighting: str = "once"
    credit_rule_modules: tuple[str, ...] = ()

    @property
    def lag_cap(self) -> Optional[int]:
        """The hard cap on a trained token's lag: ``max_lag``, or :data:`DEFAULT_MAX_LAG` under ``correct``."""
        if self.max_lag is not None or self.stale_groups != "correct":
            return self.max_lag
        return DEFAULT_MAX_LAG

    @property
    def health_thresholds(self) -> HealthThresholds:
        """``correct``'s gate: into the fallback at the two knobs, back at 1.5x the ESS and half the M2."""
        return HealthThresholds(min_ess=self.offpolicy_min_ess, max_log_ratio_m2=self.offpolicy_max_log_ratio_m2,
                                recover_ess=min(1.0, 1.5 * self.offpolicy_min_ess),
                                recover_log_ratio_m2=0.5 * self.offpolicy_max_log_ratio_m2)

    @property
    def trees(self) -> bool:
        """Whether planned micro-batches are forwarded as prefix trees: ``prefix_tree`` is ``true`` (``"auto"`` as
        start-up settled it; unsettled, rows)."""
        return self.prefix_tree is True

    def __post_init__(self) -> None:
        for name in _BOOL_FIELDS:
            _check_bool(f"traj.{name}", getattr(self, name))
        if not isinstance(self.prefix_tree, bool) and self.prefix_tree != "auto":
            raise TrajConfigError(f"traj.prefix_tree={self.prefix_tree!r} is invalid. Fix: set traj.prefix_tree=auto "
                                  "(trees where they are served, the default), true (trees, refusing what cannot serve "
                                  "them) or false (rows).", field="traj.prefix_tree")
        _check_choice("traj.group_by", self.group_by, GROUP_BY_CHOICES)
        _check_choice("traj.mini_batch_balance", self.mini_batch_balance, MINI_BATCH_BALANCE_CHOICES)
        _check_choice("traj.workload", self.workload, WORKLOAD_MODELS)
        _check_choice("traj.padded_cap", self.padded_cap, PADDED_CAP_CHOICES)
        _check_choice("traj.ratio_scope", self.ratio_scope, RATIO_SCOPES)
        _check_choice("traj.failed_groups", self.failed_groups, FAILED_GROUP_POLICIES)
        _check_choice("traj.stale_groups", self.stale_groups, STALE_GROUP_POLICIES)
        check_bound(self.max_staleness, error=TrajConfigError)
        _check_choice("traj.step_group_baseline", self.step_group_baseline, STEP_GROUP_BASELINES)
        _check_choice("traj.branch_weighting", self.branch_weighting, BRANCH_WEIGHTINGS)
        weight = self.step_advantage_weight
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight < float("inf"):
            raise TrajConfigError(
                f"traj.step_advantage_weight={weight!r} is invalid: it is GiGPO's omega, the weight of the step-level "
                "advantage. Fix: set a finite number >= 0 (1.0, the paper's; 0 trains GRPO on step rows).",
                field="traj.step_advantage_weight")
        if self.stale_groups != "drop" and self.max_staleness is None:
            raise TrajConfigError(
                f"traj.stale_groups={self.stale_groups!r} without traj.max_staleness: there is no bound to apply it at. "
                "Fix: set traj.max_staleness (a number >= 1), or remove traj.stale_groups.", field="traj.stale_groups")
        self._check_times()
        self._check_lag()
        self._check_modules()
        for name, high, what in (("tree_token_cost", float("inf"), "> 0 (a tree token's cost in row tokens)"),
                                 ("tree_margin", 1.0, "in [0, 1) (what a tree must win by)")):
            value = getattr(self, name)
            if (value is not None or name == "tree_margin") and (isinstance(value, bool) or not isinstance(
                    value, (int, float)) or not 0 <= value < high or (name == "tree_token_cost" and value == 0)):
                raise TrajConfigError(f"traj.{name}={value!r} is invalid. Fix: set a number {what}, or leave it out "
                                      "for the default.", field=f"traj.{name}")
        for name in ("loss_agg_mode", "critic_loss_agg_mode"):
            if getattr(self, name) is not None:
                _check_choice(f"traj.{name}", getattr(self, name), loss_weight_modes())
        for name in ("micro_batch_max_tokens", "infer_micro_batch_max_tokens"):
            cap = getattr(self, name)
            if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
                raise TrajConfigError(
                    f"traj.{name}={cap!r} is invalid: it is a number of tokens. Fix: set a positive integer number of "
                    "tokens per micro-batch per GPU (at least the longest prompt+response), or null to derive it from "
                    "verl's settings.",
                    field=f"traj.{name}")
        cost = self.pass_cost_tokens
        if cost is not None and (isinstance(cost, bool) or not isinstance(cost, int) or cost < 0):
            raise TrajConfigError(
                f"traj.pass_cost_tokens={cost!r} is invalid. Fix: set the fixed cost of one forward/backward pass as "
                "a non-negative number of padded positions (default 1024), or null for the fewest passes.",
                field="traj.pass_cost_tokens")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise TrajConfigError(
                f"traj.seed={self.seed!r} is invalid: the planner seeds numpy with seed + training step, which needs "
                "a non-negative int. Fix: set traj.seed to an integer >= 0 (default 0).", field="traj.seed")
        self._check_keys()

    def _check_lag(self) -> None:
        """``max_lag`` (an int >= 1, with ``max_staleness``), ``correct_fallback`` and the health thresholds."""
        lag = self.max_lag
        if lag is not None and (isinstance(lag, bool) or not isinstance(lag, int) or lag < 1):
            raise TrajConfigError(
                f"traj.max_lag={lag!r} is invalid: it is the most policy versions any trained token may be behind the "
                "policy being trained. Fix: set an integer >= 1, or null (under stale_groups=correct: "
                f"{DEFAULT_MAX_LAG}).", field="traj.max_lag")
        if lag is not None and self.max_staleness is None:
            raise TrajConfigError(
                f"traj.max_lag={lag} without traj.max_staleness: the cap acts through the staleness policy. Fix: set "
                f"traj.max_staleness (e.g. 1.0) with traj.stale_groups, or remove traj.max_lag.", field="traj.max_lag")
        _check_choice("traj.correct_fallback", self.correct_fallback, FALLBACKS)
        for name, what in (("offpolicy_min_ess", "a share in [0, 1]"),
                           ("offpolicy_max_log_ratio_m2", "a mean squared log-ratio in (0, 1]")):
            value = getattr(self, name)
            number = not isinstance(value, bool) and isinstance(value, (int, float))
            if not number or not (value <= 1 and (value >= 0 if name == "offpolicy_min_ess" else value > 0)):
                raise TrajConfigError(
                    f"traj.{name}={value!r} is invalid: it is {what}. Fix: set a number there (default "
                    f"{getattr(TrajConfig, name)}" + ("; 0 never hands over on the ESS)." if name == "offpolicy_min_ess"
                                                      else "; 1 hands over only where the weights are wild)."),
                    field=f"traj.{name}")
        if self.stale_groups != "correct":
            for name in ("correct_fallback", "offpolicy_min_ess", "offpolicy_max_log_ratio_m2"):
                if getattr(self, name) != getattr(TrajConfig, name):
                    raise TrajConfigError(
                        f"traj.{name}={getattr(self, name)!r} applies only with traj.stale_groups=correct (it is "
                        f"{self.stale_groups!r}). Fix: set traj.stale_groups=correct, or remove traj.{name}.",
                        field=f"traj.{name}")

    def _check_modules(self) -> None:
        """``credit_rule_modules``: a list of dotted module names (kept as a tuple)."""
        modules = self.credit_rule_modules
        if isinstance(modules, str) or not hasattr(modules, "__iter__") or not all(
                isinstance(m, str) and m for m in modules):
            raise TrajConfigError(
                f"traj.credit_rule_modules={modules!r} is invalid: it is a list of module names. Fix: write "
                "traj.credit_rule_modules=[my_pkg.my_rules] (each an importable module), or [] for none.",
                field="traj.credit_rule_modules")
        object.__setattr__(self, "credit_rule_modules", tuple(modules))

    def _check_times(self) -> None:
        """``trajectory_timeout_s`` and ``replay_poll_s``: positive seconds."""
        timeout = self.trajectory_timeout_s
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise TrajConfigError(
                f"traj.trajectory_timeout_s={timeout!r} is invalid: it is the seconds one trajectory may run. Fix: set "
                "a positive number of seconds, or null for no deadline.", field="traj.trajectory_timeout_s")
        poll = self.replay_poll_s
        if isinstance(poll, bool) or not isinstance(poll, (int, float)) or not 0 < poll <= 60:
            raise TrajConfigError(
                f"traj.replay_poll_s={poll!r} is invalid: it is how often (seconds) the v1 trainer checks whether the "
                "step's groups are done. Fix: set a number in (0, 60] (default 2.0, verl's own; 0.25 ends the quick start's generation up to 2 s sooner).",
                field="traj.replay_poll_s")

    def _check_keys(self) -> None:
        """``traj_id_key`` / ``step_index_key``: two distinct non-empty names, none a field the plan writes."""
        for name in ("traj_id_key", "step_index_key"):
            value = getattr(self, name)
            fix = (f"Fix: set traj.{name} to the non_tensor_batch field your agent loop writes (default "
                   f"{'traj_id' if name == 'traj_id_key' else 'step_index'!r}).")
            if not isinstance(value, str) or not value:
                raise TrajConfigError(f"traj.{name}={value!r} must be a non-empty field name. {fix}",
                                      field=f"traj.{name}")
            if value in PLAN_KEYS or value == IS_LAST_STEP:
                raise TrajConfigError(
                    f"traj.{name}={value!r} is a field verl_traj writes itself ({list(PLAN_KEYS) + [IS_LAST_STEP]}): "
                    f"the plan would overwrite it. {fix}", field=f"traj.{name}")
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
        known = sorted(f.name for f in fields(cls))
        unknown = sorted(str(k) for k in data if k not in known)
        if unknown:
            close = difflib.get_close_matches(unknown[0], known, n=1)
            hint = f"traj.{close[0]} (did you mean it for {unknown[0]!r}?)" if close else "traj.micro_batch_max_tokens=8192"
            raise TrajConfigError(
                f"unknown key(s) in traj: {unknown}. Valid keys: {known}. Fix: check the spelling in your overrides "
                f"(e.g. {hint}).", field="traj",
            )
        return cls(**data)

    @classmethod
    def of(cls, config: Any) -> "TrajConfig":
        """The ``traj:`` section of verl's whole config, parsed once per config object (agent loops read it per session):
        cached by the object's identity (``id``, checked against a weak reference), never by its hash or equality (an
        OmegaConf config hashes its whole tree: ~0.1-0.5 s for verl's). A config is read as it was at its first lookup
        (verl does not change ``traj:`` after start-up); a plain dict is parsed each time."""
        key = id(config)
        entry = _PARSED.get(key)
        if entry is not None and entry[0]() is config:
            return entry[1]
        parsed = cls.from_mapping(config.get("traj") if config is not None else None)
        try:
            ref = weakref.ref(config, functools.partial(_drop, key))
        except TypeError:  # not weak-referenceable (a plain dict, None): parse each time
            return parsed
        _PARSED[key] = (ref, parsed)
        return parsed

    @staticmethod
    def forget(config: Any) -> None:
        """Drop ``config``'s parse: start-up settled a value in it (``traj.prefix_tree=auto``)."""
        _PARSED.pop(id(config), None)


_PARSED: dict[int, tuple["weakref.ref[Any]", TrajConfig]] = {}  # id -> (weak ref, parse); leaves with its config


def _drop(key: int, ref: "weakref.ref[Any]") -> None:
    """A collected config's entry leaves, only if it is still that config's (its id may serve a newer config)."""
    entry = _PARSED.get(key)
    if entry is not None and entry[0] is ref:
        del _PARSED[key]


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
    """``value`` one of ``choices`` (a near-miss is named), else :class:`TrajConfigError` naming the field."""
    check_choice(field, value, choices, error=TrajConfigError)
