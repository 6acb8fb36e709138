"""Step rows of sessions whose LLM calls branch (issue 56) inside verl's advantage step: the tree fields read once and
removed, outcome estimators run over the leaves, the two-sign part written for the loss.

v0's expansion writes :data:`~verl_traj.core.keys.TREE_CALLS` / :data:`~verl_traj.core.keys.TREE_OUTCOMES`; v1's
agent-loop worker tags each row with them and the plan's facts put them back on their tokens. A batch with them takes
:func:`outcome_on_trees` for an outcome estimator (GRPO, RLOO, ...: over the leaves of each prompt's sessions) or a
credit rule registered with ``trees=True`` (``tree_grpo``); anything else is refused here, before any update, naming
the estimator and the fix (start-up cannot know whether an agent's sessions will branch).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch

from verl_traj.core.keys import (ADVANTAGE_METRICS, ADVANTAGES_NEGATIVE, IS_LAST_STEP, PATH_COPIES, TRAJ_INDEX,
                                 TREE_CALLS, TREE_OUTCOMES, TURN_REWARDS)
from verl_traj.core.plan.estimators import estimator_traits
from verl_traj.stepwise.advantages import StepwiseAdvantageError, last_step_rows, run_outcome_estimator
from verl_traj.stepwise.tree_credit import tree_credit

__all__ = ["has_trees", "outcome_on_trees", "refuse_on_trees", "refuse_trajectory_ratios", "take_tree_fields",
           "write_tree_parts"]

_FIX = ("Fix: set algorithm.adv_estimator to an outcome estimator (grpo, rloo, ...) or tree_grpo for agents whose "
        "sessions fork, spawn sub-agents or condense (docs/branching.md), or record each session as one chain.")


def has_trees(td: Any) -> bool:
    """The batch holds a branching session's rows (its tree fields are present)."""
    return TREE_CALLS in td.keys()


def refuse_on_trees(name: str, why: str) -> None:
    raise StepwiseAdvantageError(f"algorithm.adv_estimator={name!r} on a batch whose sessions branch (forks, sub-agents "
                                 f"or condensation): {why}. {_FIX}", field="algorithm.adv_estimator")


def refuse_trajectory_ratios(ratio_scope: str) -> None:
    """A session's sequence ratio over a call tree is not defined (a root-to-leaf path's would be): refused."""
    if ratio_scope == "trajectory":
        raise StepwiseAdvantageError(
            "traj.ratio_scope=trajectory on a batch whose sessions branch (forks, sub-agents or condensation): a "
            "trajectory-scoped ratio over a call tree is not defined yet. Fix: set traj.ratio_scope=row (the default) "
            "for agents that branch.", field="traj.ratio_scope")


def take_tree_fields(td: Any) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(tree_calls, tree_outcomes)`` ``[B, R]`` of the batch, removed from it (the update does not read them);
    ``(None, None)`` without."""
    if not has_trees(td):
        return None, None
    calls, outcomes = td[TREE_CALLS], td[TREE_OUTCOMES]
    del td[TREE_CALLS]
    del td[TREE_OUTCOMES]
    return calls, outcomes


def write_tree_parts(td: Any, negative: Optional[torch.Tensor], copies: Optional[torch.Tensor]) -> None:
    """Put the two-sign part and (``expanded``) each token's path copies where the loss reads them, each only where it
    differs from the default (a part that is 0, one copy): a batch without keeps verl's fields."""
    device = td["advantages"].device
    if negative is not None and bool((negative != 0).any()):
        td[ADVANTAGES_NEGATIVE] = negative.to(device)
    if copies is not None and bool((copies > 1).any()):
        td[PATH_COPIES] = copies.to(device)


def outcome_on_trees(data: Any, name: str, fn: Callable, extra: dict, rewards: torch.Tensor, uid: np.ndarray, *,
                     weighting: str, use_kl_in_reward: bool) -> None:
    """An outcome estimator's advantages on a batch with branching sessions, in place (``advantages``, ``returns``,
    the two-sign part, ``traj_tree/*`` metrics): the estimator over the leaves of every session of a prompt, each call
    the parts of the leaves below it (:func:`~verl_traj.stepwise.tree_credit.tree_credit`)."""
    traits = estimator_traits(name)
    if traits.temporal:
        refuse_on_trees(name, "returns and values over a call tree are not defined for this estimator yet")
    if traits.length_aware or name == "remax":
        refuse_on_trees(name, "its baseline reads each response's length or a greedy rollout, which a leaf does not "
                              "have")
    if use_kl_in_reward or TURN_REWARDS in data.batch.keys():
        raise StepwiseAdvantageError(
            "a batch whose sessions branch carries per-token rewards (algorithm.use_kl_in_reward=true or turn "
            "rewards): a leaf's outcome on a tree is its own or its session's. Fix: set algorithm.use_kl_in_reward="
            "false (use actor_rollout_ref.actor.use_kl_loss for a KL term) and give no per-call rewards.",
            field="algorithm.use_kl_in_reward" if use_kl_in_reward else TURN_REWARDS)
    td = data.batch
    calls, outcomes = take_tree_fields(td)
    traj = td[TRAJ_INDEX]
    last = last_step_rows(traj.cpu(), data.non_tensor_batch[IS_LAST_STEP])
    score = rewards.detach().cpu().to(torch.float64).sum(-1)[last]

    def over_leaves(leaf_outcomes: torch.Tensor, group: np.ndarray) -> torch.Tensor:
        return run_outcome_estimator(fn, leaf_outcomes.to(torch.float32), group, estimator_name=name,
                                     estimator_kwargs=extra)[0]

    credit = tree_credit(score, td["response_mask"], traj, calls, outcomes, np.asarray(uid, dtype=object)[last.numpy()],
                         over_leaves, weighting=weighting)
    td["advantages"] = credit.advantages
    td["returns"] = credit.advantages.clone()
    write_tree_parts(td, credit.negative, credit.copies)
    data.meta_info[ADVANTAGE_METRICS] = credit.metrics()
