"""Per-call credit rules inside verl (:mod:`verl_traj.stepwise.credit_rules`: GiGPO and any rule registered there):
their names in verl's estimator registry, and the advantage of a planned step-row batch under one of them (both
trainers: v0's ``compute_advantage`` patch and v1's ``planned_advantage`` reach it through
:func:`~verl_traj.integration.rows.stepwise_rows.stepwise_advantage`).

A rule that reads anchor keys (``anchors=True``, GiGPO) finds them in the step rows (``step_anchors``, ``[B, R]``):
v0's expansion writes them, v1's agent-loop worker tags each row with its calls' keys
(:data:`~verl_traj.core.rollout.row_tags.STEP_ANCHOR_TAG`) and the plan's facts put them back on their tokens.
:func:`credit_advantage` builds the rule's :class:`~verl_traj.stepwise.credit_rules.CallCredit` with verl's GRPO as
the episode-level estimator; the rule's metrics travel in the batch's ``meta_info`` (:data:`ADVANTAGE_METRICS`) to
the step's metrics.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from verl.trainer.ppo import core_algos

from verl_traj.core.errors import TrajInputError
from verl_traj.core.keys import ADVANTAGE_METRICS, IS_LAST_STEP, STEP_ANCHORS, TRAJ_INDEX
from verl_traj.integration.rows.branching import (refuse_on_trees, refuse_trajectory_ratios, take_tree_fields,
                                                write_tree_parts)
from verl_traj.stepwise.advantages import last_step_rows, run_outcome_estimator
from verl_traj.stepwise.credit_rules import CREDIT_RULES, CallCredit, CreditRule, credit_rule, load_credit_rule_modules
from verl_traj.stepwise.step_groups import StepGroupOptions

__all__ = ["ADVANTAGE_METRICS", "credit_advantage", "load_rules", "records_anchors", "register_rules_with_verl"]


def _outside_step_rows(name: str, token_level_rewards: Any = None, response_mask: Any = None, index: Any = None,
                       **kwargs: Any) -> Any:
    """What verl's registry runs for a per-call rule on a batch without step rows: a refusal, never a silent GRPO."""
    raise TrajInputError(
        f"algorithm.adv_estimator={name!r} reached verl's own advantage path, on a batch without step rows: it is a "
        "per-call credit rule (each LLM call its own advantage), so it needs one row per call. Fix: set "
        "traj.enable=true and traj.step_wise=true with a step-recording agent loop (docs/agent_loops.md), or another "
        "estimator (grpo).", field="algorithm.adv_estimator")


def register_rules_with_verl() -> None:
    """Put every registered rule's name in verl's estimator registry (idempotent): verl's config and start-up checks
    accept the name, and a batch that reaches verl's own path with it is refused."""
    for name in CREDIT_RULES:
        entry = core_algos.ADV_ESTIMATOR_REGISTRY.get(name)
        if getattr(entry, "func", None) is _outside_step_rows:
            continue
        if entry is not None:
            raise TrajInputError(
                f"credit rule {name!r} has the name of one of verl's own estimators ({entry.__module__}."
                f"{getattr(entry, '__qualname__', entry)}). Fix: register the rule under another name.",
                field="algorithm.adv_estimator")
        core_algos.register_adv_est(name)(functools.partial(_outside_step_rows, name))


def load_rules(credit_rule_modules: Sequence[str]) -> None:
    """This process's rules: ``traj.credit_rule_modules`` imported (each registers its rules), every rule's name in
    verl's registry. Start-up, both trainers and v1's agent-loop workers call it (each a process of its own)."""
    load_credit_rule_modules(credit_rule_modules)
    register_rules_with_verl()


def records_anchors(adv_estimator: Any) -> bool:
    """The estimator is a rule that reads each call's anchor key (the step rows must carry them)."""
    rule = credit_rule(adv_estimator)
    return rule is not None and rule.anchors


def _anchors(td: Any, rule: CreditRule) -> Optional[torch.Tensor]:
    """The rows' ``step_anchors`` where ``rule`` reads them (then removed: the update does not need them)."""
    if not rule.anchors:
        return None
    if STEP_ANCHORS not in td.keys():
        raise TrajInputError(
            f"batch[{STEP_ANCHORS!r}] is missing: the credit rule {rule.name!r} reads each LLM call's anchor key, which "
            f"the step rows carry when algorithm.adv_estimator={rule.name} at rollout. Fix: keep the field through the "
            "batch (a custom expansion must pass step_anchors=True to expand_step_rows).", field=STEP_ANCHORS)
    anchors = td[STEP_ANCHORS]
    del td[STEP_ANCHORS]  # read once: the update does not need it
    return anchors


def credit_advantage(data: Any, rule: CreditRule, rewards: torch.Tensor, steps: Any, uid: np.ndarray, *,
                     gamma: float, episode: tuple[Callable, dict], options: Optional[StepGroupOptions]) -> None:
    """``rule``'s advantages of a planned step-row batch (verl ``DataProto``), in place: ``advantages`` and ``returns``,
    metrics under ``meta_info[ADVANTAGE_METRICS]``.

    ``rewards``: ``[B, R]`` token rewards with the turn rewards on their tokens; ``steps``: ``[B]`` each row's step;
    ``uid``: ``[B]`` GRPO ids; ``episode``: verl's GRPO and the keyword arguments it accepts (its normalisation);
    ``options``: the ``traj:`` knobs (required: a caller that did not wire them is an error, not a default)."""
    if options is None:
        raise RuntimeError("credit_advantage needs the traj: section's StepGroupOptions (the caller did not pass them)")
    td = data.batch
    fn, kwargs = episode

    def episode_fn(scores: torch.Tensor, traj_uid: np.ndarray) -> torch.Tensor:
        return run_outcome_estimator(fn, scores, traj_uid, estimator_name="grpo", estimator_kwargs=kwargs)[0]

    last = last_step_rows(td[TRAJ_INDEX].cpu(), data.non_tensor_batch[IS_LAST_STEP])  # one row per trajectory
    tree_calls, tree_outcomes = take_tree_fields(td)
    if tree_calls is not None and not rule.trees:
        refuse_on_trees(rule.name, "this credit rule reads each session as one chain of calls (register a rule with "
                                   "trees=True to credit a call tree)")
    if tree_calls is not None:
        refuse_trajectory_ratios(options.ratio_scope)
    calls = CallCredit(
        rewards=rewards, response_mask=td["response_mask"], traj_index=td[TRAJ_INDEX], steps=np.asarray(steps),
        traj_uid=np.asarray(uid, dtype=object)[last.numpy()], episode_fn=episode_fn, gamma=float(gamma),
        norm_by_std=bool(kwargs.get("norm_adv_by_std_in_grpo", True)), anchors=_anchors(td, rule),
        step_advantage_weight=options.weight, step_group_baseline=options.baseline, tree_calls=tree_calls,
        tree_outcomes=tree_outcomes, branch_weighting=options.branch_weighting)
    result = rule.fn(calls)
    mask = td["response_mask"]
    if not isinstance(result.advantages, torch.Tensor) or result.advantages.shape != mask.shape:
        raise TrajInputError(
            f"credit rule {rule.name!r} returned advantages of shape {tuple(getattr(result.advantages, 'shape', ()))}, "
            f"expected {tuple(mask.shape)} (one per response position of each row). Fix the rule's "
            "CreditResult.advantages.", field="algorithm.adv_estimator")
    td["advantages"] = result.advantages.to(mask.device)
    td["returns"] = (result.returns.to(mask.device) if result.returns is not None else td["advantages"].clone())
    write_tree_parts(td, result.negative, result.copies)
    data.meta_info[ADVANTAGE_METRICS] = dict(result.metrics)


register_rules_with_verl()  # verl's extension point, as its own estimators register at import
