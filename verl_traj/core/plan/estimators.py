"""What verl_traj knows about each advantage estimator, by name: one registry read by the start-up check
(:mod:`verl_traj.config`), the step-wise advantage path (:mod:`verl_traj.stepwise.advantages`) and the
real-row wrapper (:mod:`verl_traj.integration.rows.real_rows`), so they cannot disagree.

Pure module (stdlib and :mod:`verl_traj.core.errors`). The names are verl 0.9.1's ``AdvantageEstimator``
values; a test walks every estimator verl registers (``core_algos.ADV_ESTIMATOR_REGISTRY``) and checks it has an
entry here. A name verl_traj does not know (a user's ``register_adv_est``) gets :data:`CUSTOM`: refused with step rows
unless its output is checked to be ``scalar * response_mask`` (the step-wise adapter does this at run time).

Traits:

* ``scalar_outcome``: the advantage of a response is one scalar times its ``response_mask`` (GRPO-style):
  it can be computed once per trajectory and broadcast onto the trajectory's step rows.
* ``length_aware``: the baseline weights responses by their length (``opo``): per trajectory, the
  ``[T, 1]`` mask carries the trajectory's loss-token count.
* ``temporal``: per-token returns over time (``gae``, REINFORCE++), or token-level whitening: with step rows they
  run on each trajectory's timeline (its rows' response tokens in step order, :mod:`verl_traj.stepwise.timeline`),
  so a turn gets credit from the turns after it.
* ``padding_safe``: the real rows' outputs do not change when verl_traj's padding rows (groups of one with
  no loss token) are present, so the estimator may run on the whole batch (a test checks each).
* ``per_call``: a per-call credit rule, from step rows only (``gigpo``: GiGPO's anchor-state step groups): declared
  by :func:`verl_traj.stepwise.credit_rules.register_credit_rule` next to the rule, never here; refused without
  ``traj.step_wise=true``.
* ``step_rows``: allowed with ``traj.step_wise=true`` (scalar outcome: once per trajectory, broadcast; temporal: on
  the timeline; per call: the rule); ``refusal`` says why not where it is not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verl_traj.core.errors import TrajInputError

__all__ = ["BRANCH_WEIGHTINGS", "CUSTOM", "ESTIMATORS", "STEP_GROUP_BASELINES", "EstimatorTraits", "estimator_name", "estimator_traits", "register_estimator_traits",
           "step_row_estimators", "step_row_refusal"]


@dataclass(frozen=True)
class EstimatorTraits:
    """What verl_traj relies on about one advantage estimator (module docstring)."""

    scalar_outcome: bool = False
    length_aware: bool = False
    temporal: bool = False
    padding_safe: bool = False
    per_call: bool = False
    refusal: str = ""  # non-empty: why the estimator cannot run on step rows

    @property
    def step_rows(self) -> bool:
        return (self.scalar_outcome or self.temporal or self.per_call) and not self.refusal


ESTIMATORS: dict[str, EstimatorTraits] = {}
STEP_GROUP_BASELINES = ("gigpo", "leave_one_out")  # traj.step_group_baseline (verl_traj.stepwise.step_groups)
BRANCH_WEIGHTINGS = ("once", "expanded", "paths")  # traj.branch_weighting (verl_traj.stepwise.tree_credit)
CUSTOM = EstimatorTraits(refusal="it is not one of verl_traj's known estimators, so its output is not known to be "
                                 "one scalar per response")

_TOKEN_BASELINE = "its baseline is per token over a row's positions, which differ between a trajectory's step rows"


def register_estimator_traits(name: str, traits: EstimatorTraits, *, override: bool = False) -> EstimatorTraits:
    """Declare ``traits`` for estimator ``name`` (for a user's ``register_adv_est`` estimator). A name already
    declared is refused unless ``override=True`` (verl's ``register_adv_est`` refuses duplicates too)."""
    if name in ESTIMATORS and not override and ESTIMATORS[name] != traits:
        raise TrajInputError(f"advantage estimator {name!r} already has traits {ESTIMATORS[name]}. Fix: pass "
                             "override=True to replace them.", field="adv_estimator")
    ESTIMATORS[name] = traits
    return traits


def estimator_name(adv_estimator: Any) -> str:
    """The registry name of a verl ``AdvantageEstimator`` enum member or a string."""
    return str(getattr(adv_estimator, "value", adv_estimator))


def estimator_traits(adv_estimator: Any) -> EstimatorTraits:
    """The traits of ``adv_estimator`` (name or enum); :data:`CUSTOM` for a name verl_traj does not know."""
    return ESTIMATORS.get(estimator_name(adv_estimator), CUSTOM)


def step_row_estimators() -> tuple[str, ...]:
    """Names allowed with step rows (what the error messages list)."""
    return tuple(name for name, t in ESTIMATORS.items() if t.step_rows)


def step_row_refusal(adv_estimator: Any, *, allow_custom: bool = True) -> str:
    """Why ``adv_estimator`` cannot run on step rows (``traj.step_wise=true``), as the message to raise; ``""``
    where it can. The start-up check and the step-wise advantage path both ask this one function. A custom name
    passes with ``allow_custom`` (its output is then checked to be one scalar per response)."""
    name = estimator_name(adv_estimator)
    traits = ESTIMATORS.get(name)
    if traits is None and allow_custom:
        return ""
    traits = traits or CUSTOM
    if traits.step_rows:
        return ""
    return (f"algorithm.adv_estimator={name!r} cannot be used with traj.step_wise=true: {traits.refusal}. Use an "
            f"estimator that runs on step rows ({', '.join(step_row_estimators())}) or set traj.step_wise=false to train each "
            "trajectory as one concatenated row.")


for _name, _traits in {
    "grpo": EstimatorTraits(scalar_outcome=True, padding_safe=True),
    "grpo_vectorized": EstimatorTraits(scalar_outcome=True),
    "rloo": EstimatorTraits(scalar_outcome=True, padding_safe=True),
    "rloo_vectorized": EstimatorTraits(scalar_outcome=True, padding_safe=True),
    "opo": EstimatorTraits(scalar_outcome=True, length_aware=True, padding_safe=True),
    "grpo_passk": EstimatorTraits(scalar_outcome=True),  # needs config; a group of one moves it
    "gpg": EstimatorTraits(scalar_outcome=True),  # batch-level statistic
    "remax": EstimatorTraits(scalar_outcome=True),  # needs reward_baselines per trajectory
    "gae": EstimatorTraits(temporal=True, padding_safe=True),
    "reinforce_plus_plus": EstimatorTraits(temporal=True, padding_safe=True),
    # a group baseline per response, then whitening over the batch's tokens: on the timeline, one response per
    # trajectory and the same tokens whitened
    "reinforce_plus_plus_baseline": EstimatorTraits(temporal=True, padding_safe=True),
    "optimal_token_baseline": EstimatorTraits(refusal=_TOKEN_BASELINE),
    "tir_optimal_token_baseline": EstimatorTraits(refusal=_TOKEN_BASELINE),
    # verl_traj's per-call rules (gigpo, ...) declare their traits where they are registered (stepwise.credit_rules)
    "gdpo": EstimatorTraits(refusal="it whitens each reward dimension over a batch's rows, and reads per-dimension "
                                    "reward keys that exist per row, not per trajectory"),
}.items():
    register_estimator_traits(_name, _traits)
