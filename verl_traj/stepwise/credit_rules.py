"""Per-call credit rules in one registry: a rule is a function of a step-row batch's calls, added with one decorator.

A *per-call* (step-level) credit rule gives each LLM call of a trajectory its own advantage, from what the step rows
carry: every token reward (the outcome on the last call, turn rewards on their calls), each row's step, the
trajectory's GRPO group and, where the rule asks for them, each call's anchor key (the state it acted from,
:mod:`~verl_traj.stepwise.anchors`). GiGPO (:mod:`~verl_traj.stepwise.step_groups`) is one; a new rule is one
function and one registration next to it, as verl adds an estimator with ``register_adv_est``::

    @register_credit_rule("my_rule", anchors=False)
    def my_rule(calls: CallCredit) -> CreditResult:
        ...  # advantages [B, R] on the rows' response tokens

The name is then a valid ``algorithm.adv_estimator`` with ``traj.step_wise=true`` on both trainers: start-up accepts
it (refused without step rows, with the fix), the agent loops record anchor keys where the rule reads them, and the
advantage step (:func:`verl_traj.integration.rows.stepwise_rows.stepwise_advantage`) runs it. A module of rules is
loaded in every process that needs it by ``traj.credit_rule_modules`` (:func:`load_credit_rule_modules`).

Pure module: torch, numpy and stdlib; the estimator traits live in :mod:`verl_traj.core.plan.estimators`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from verl_traj.core.errors import TrajInputError
from verl_traj.core.plan.estimators import EstimatorTraits, estimator_name, register_estimator_traits

__all__ = ["CREDIT_RULES", "CallCredit", "CreditResult", "CreditRule", "credit_rule", "load_credit_rule_modules",
           "register_credit_rule"]

# the traj: knobs a rule may declare it reads (start-up refuses them where the chosen rule does not read them)
RULE_KNOBS = ("step_advantage_weight", "step_group_baseline")


@dataclass(frozen=True)
class CallCredit:
    """What a per-call credit rule reads of a planned step-row batch: ``B`` rows (padding rows have
    ``traj_index == -1``: their advantage must be 0), ``R`` response positions, ``T`` trajectories.

    Invariants: every real row's trajectory is in ``0..T-1``; a trajectory's rows are its calls in step order (a
    prefix-merged row holds several calls, observations between them masked); ``anchors`` is ``None`` unless the rule
    was registered with ``anchors=True``."""

    rewards: torch.Tensor  # [B, R] float: every token reward (outcome on the last call, turn rewards, KL-in-reward)
    response_mask: torch.Tensor  # [B, R] the loss tokens
    traj_index: torch.Tensor  # [B] int64, dense 0..T-1, -1 on padding
    steps: np.ndarray  # [B] each row's step (its first call's)
    traj_uid: np.ndarray  # [T] object: each trajectory's GRPO group id
    episode_fn: Callable[[torch.Tensor, np.ndarray], torch.Tensor]  # verl's GRPO over trajectories: [T], [T] -> [T]
    gamma: float
    norm_by_std: bool  # algorithm.norm_adv_by_std_in_grpo
    anchors: Optional[torch.Tensor] = None  # [B, R] int64: each call's anchor key on its first response token
    step_advantage_weight: float = 1.0  # traj.step_advantage_weight
    step_group_baseline: str = "gigpo"  # traj.step_group_baseline
    # a rule registered with trees=True (issue 56): each call's packed leaf span and the leaves' own outcomes ([B, R],
    # stepwise.tree_credit; zeros where no session of the batch branches) and traj.branch_weighting
    tree_calls: Optional[torch.Tensor] = None
    tree_outcomes: Optional[torch.Tensor] = None
    branch_weighting: str = "once"


@dataclass(frozen=True)
class CreditResult:
    """A rule's output: ``advantages`` ``[B, R]`` (0 off the loss tokens and on padding rows), ``returns`` ``[B, R]``
    (``None``: the advantages, as verl's GRPO), the step's metrics (``traj_<rule>/*``, floats) and, for a rule on
    trees, ``negative`` ``[B, R]``: the part of ``advantages`` the loss evaluates on its own (a call whose leaves have
    both signs, :mod:`~verl_traj.stepwise.tree_credit`; ``None``: none) and ``copies``."""

    advantages: torch.Tensor
    returns: Optional[torch.Tensor] = None
    metrics: dict[str, float] = field(default_factory=dict)
    negative: Optional[torch.Tensor] = None
    copies: Optional[torch.Tensor] = None  # [B, R] traj.branch_weighting=expanded: each token's root-to-leaf paths


@dataclass(frozen=True)
class CreditRule:
    """One registered rule: its function, whether it reads anchor keys, which ``traj:`` knobs it reads, whether it
    credits sessions whose calls branch (``trees``; any other rule is refused on such a batch)."""

    name: str
    fn: Callable[[CallCredit], CreditResult]
    anchors: bool = False
    knobs: tuple[str, ...] = ()
    trees: bool = False


CREDIT_RULES: dict[str, CreditRule] = {}


def register_credit_rule(name: str, *, anchors: bool = False, knobs: Sequence[str] = (), trees: bool = False,
                         override: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn(calls: CallCredit) -> CreditResult`` as the per-call rule ``name`` (an
    ``algorithm.adv_estimator`` value). ``anchors``: the rule reads each call's anchor key (the agent loops then
    record them); ``knobs``: the ``traj:`` knobs it reads (:data:`RULE_KNOBS`); ``trees``: it reads
    :attr:`CallCredit.tree_calls` and credits branching sessions. A name already registered (as a rule
    or as one of verl's estimators) is refused unless ``override``."""
    unknown = [k for k in knobs if k not in RULE_KNOBS]
    if unknown:
        raise TrajInputError(f"register_credit_rule({name!r}, knobs={list(knobs)}): {unknown} are not traj: knobs a "
                             f"rule may read. Fix: name some of {list(RULE_KNOBS)}, or none.", field="knobs")

    def register(fn: Callable[[CallCredit], CreditResult]) -> Callable[[CallCredit], CreditResult]:
        rule = CreditRule(name=name, fn=fn, anchors=bool(anchors), knobs=tuple(knobs), trees=bool(trees))
        if name in CREDIT_RULES and not override and CREDIT_RULES[name].fn is not fn:
            raise TrajInputError(f"credit rule {name!r} is already registered ({CREDIT_RULES[name].fn.__module__}."
                                 f"{CREDIT_RULES[name].fn.__qualname__}). Fix: choose another name, or pass "
                                 "override=True to replace it.", field="name")
        register_estimator_traits(name, EstimatorTraits(per_call=True, padding_safe=True),
                                  override=override or name in CREDIT_RULES)
        CREDIT_RULES[name] = rule
        return fn

    return register


def credit_rule(adv_estimator: Any) -> Optional[CreditRule]:
    """The registered rule of ``adv_estimator`` (a name or verl's enum member); ``None`` for any other estimator."""
    return CREDIT_RULES.get(estimator_name(adv_estimator))


def load_credit_rule_modules(modules: Sequence[str]) -> None:
    """Import each module of ``traj.credit_rule_modules`` (each registers its rules at import), in this process: the
    driver's start-up checks, the trainer and the agent loops each call it. A module that cannot be imported is
    refused with the field and the fix."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise TrajInputError(
                f"traj.credit_rule_modules names {module!r}, which cannot be imported ({exc}). Fix: give the dotted "
                "name of an importable module that registers its rules with register_credit_rule (on PYTHONPATH in "
                "every Ray process), or remove it.", field="traj.credit_rule_modules") from exc
