"""Step-level credit without a critic: GiGPO's anchor-state groups (arXiv 2505.10978) on step rows.

GiGPO adds to GRPO's episode-level advantage ``A_E(tau)`` (a trajectory's return normalised in its GRPO group) a
step-level one: each LLM call's discounted return ``R_t = sum_{k >= t} gamma^(k - t) r_k`` (turn rewards, the
outcome on the last call), normalised among the calls of the same GRPO group that acted from the same **anchor
state** (equal anchor keys). Every loss token of call ``t`` of trajectory ``tau`` gets
``A_E(tau) + omega * A_S(t)``.

The calls are found from one per-token field, ``step_anchors`` ``[B, R]`` int64: each call's anchor key (a
positive 63-bit hash, :func:`~verl_traj.stepwise.anchors.observation_anchor`) on its FIRST response token, 0
elsewhere. A call spans from there to the next call's first token (or the row's end), so step rows and their
prefix-merged rows (several calls per row, observations between them masked) describe the same calls, and get the
same advantage on every loss token. A trajectory's calls are ordered by (its rows' step, position in the row).

Step-group baselines (``traj.step_group_baseline``):

* ``gigpo``: the paper's ``(R_t - mean) / (std + eps)`` over the step group (``std`` as verl's GRPO: unbiased,
  only with ``norm_adv_by_std_in_grpo``); a call alone in its group gets 0 (``R_t - R_t``; verl-agent's code gives
  it its raw return instead, a signal with no baseline).
* ``leave_one_out``: ``R_t - mean of the OTHER calls' R`` in the group, no std: the mean of the estimate given the
  state and action is ``Q(s, a) - V(s)`` exactly where the key is the state (Markov) and a trajectory visits it at
  most once (the others are then independent visits of ``s``); a call alone gets 0.

Per-turn-index normalisation (verl RFC 7244) is this module with the turn index as anchor key; it is biased when
the policy decides when to stop (the calls at index ``k`` come from different states): ``tests/stepwise/
test_step_groups.py`` shows it beside the anchor baseline on a synthetic game with known advantages.

Pure module: torch and numpy. No Python loop over rows or calls (one over a trajectory's step positions for the
discounted return, vectorised across trajectories, as verl's own estimators loop over positions).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

import numpy as np
import torch

from verl_traj.core.errors import TrajInputError, check_finite, check_index
from verl_traj.core.plan.estimators import STEP_GROUP_BASELINES as BASELINES
from verl_traj.stepwise.credit_rules import CallCredit, CreditResult, register_credit_rule

__all__ = ["BASELINES", "StepCalls", "StepGroupOptions", "combine_advantages", "discounted_step_returns", "gigpo_advantages", "gigpo_rule",
           "step_group_advantages", "step_group_ids", "step_group_metrics"]

ANCHORS = "step_anchors"  # the per-token field (verl_traj.core.keys.STEP_ANCHORS)


@dataclass(frozen=True)
class StepGroupOptions:
    """The credit knobs of the ``traj:`` section: GiGPO's (``traj.step_advantage_weight``,
    ``traj.step_group_baseline``), a branching session's weighting (``traj.branch_weighting``) and the ratio scope
    its rows are refused under (``traj.ratio_scope``)."""

    weight: float = 1.0
    baseline: str = "gigpo"
    branch_weighting: str = "once"
    ratio_scope: str = "row"

    @classmethod
    def of(cls, traj_config: Any) -> "StepGroupOptions":
        return cls(weight=float(traj_config.step_advantage_weight), baseline=str(traj_config.step_group_baseline),
                   branch_weighting=str(traj_config.branch_weighting), ratio_scope=str(traj_config.ratio_scope))


@dataclass(frozen=True)
class StepCalls:
    """Every LLM call (step) of a batch's real rows, ``S`` calls in row-major order of their first token.

    ``traj`` / ``order``: the call's trajectory and its position ``0..n_t - 1`` among the trajectory's calls;
    ``token_call`` ``[B, R]``: the call each response position belongs to (``-1``: none, padding rows); ``reward``
    accumulation and the advantage's scatter both read it."""

    row: torch.Tensor  # [S] int64
    anchor: torch.Tensor  # [S] int64, > 0
    traj: torch.Tensor  # [S] int64
    order: torch.Tensor  # [S] int64
    token_call: torch.Tensor  # [B, R] int64
    num_trajectories: int

    @classmethod
    def build(cls, anchors: torch.Tensor, traj_index: torch.Tensor, step_index: Any,
              response_mask: torch.Tensor) -> "StepCalls":
        """From ``step_anchors`` ``[B, R]`` (int64 >= 0), the plan's ``traj_index`` ``[B]`` (dense, -1 on padding),
        each row's step ``[B]`` and ``response_mask`` ``[B, R]``. Refused (naming the field): a loss token of a real
        row before its row's first call (a missing anchor key), two rows of one trajectory with the same step."""
        if not isinstance(anchors, torch.Tensor) or anchors.dim() != 2 or anchors.is_floating_point():
            raise TrajInputError.invalid(ANCHORS, anchors, "is not a [B, R] integer tensor", "keep step_anchors as "
                                         "the step-row expansion wrote them (traj.step_anchors, gigpo)")
        anchors = anchors.detach().cpu().long()
        rows = anchors.shape[0]
        traj_index = check_index("traj_index", traj_index, "pass the plan's traj_index", rows=rows, low=-1)
        step_index = check_index("step_index", step_index, "pass each row's step", rows=rows)
        mask = response_mask.detach().cpu() != 0
        if tuple(mask.shape) != tuple(anchors.shape):
            raise TrajInputError.invalid("response_mask", response_mask, f"has shape {tuple(mask.shape)}, "
                                         f"step_anchors {tuple(anchors.shape)}", "pass the batch's response_mask")
        real = (traj_index >= 0)[:, None]
        if bool((anchors < 0).any()):
            raise TrajInputError.invalid(ANCHORS, anchors.min(), "is negative", "anchor keys are positive hashes")
        starts = (anchors > 0) & real
        within = torch.cumsum(starts.long(), 1) - 1  # the call of each position within its row
        orphan = mask & real & (within < 0)
        if bool(orphan.any()):
            b = int(torch.nonzero(orphan)[0, 0])
            raise TrajInputError(
                f"row {b} (trajectory {int(traj_index[b])}) has loss tokens but no anchor key before them: GiGPO "
                "cannot tell which LLM call they belong to. Fix: keep the step rows' step_anchors (written by the "
                "step-row expansion when algorithm.adv_estimator=gigpo; an agent loop's own keys come from "
                "StepRecordingMixin.anchor_keys, one per recorded call).", field=ANCHORS)
        row, _ = torch.nonzero(starts, as_tuple=True)
        offset = torch.cumsum(starts.sum(1), 0) - starts.sum(1)
        token_call = torch.where(real & (within >= 0), offset[:, None] + within, torch.full_like(within, -1))
        traj = traj_index[row]
        _check_steps(traj_index, step_index)
        num_t = int(traj_index.max()) + 1 if rows and bool((traj_index >= 0).any()) else 0
        key = np.lexsort((np.arange(row.numel()), step_index[row].numpy(), traj.numpy()))  # (traj, step, position)
        key = torch.from_numpy(key)
        sorted_traj = traj[key]
        first = torch.searchsorted(sorted_traj, sorted_traj, right=False)
        order = torch.empty_like(row)
        order[key] = torch.arange(row.numel()) - first
        return cls(row=row, anchor=anchors[starts], traj=traj, order=order, token_call=token_call,
                   num_trajectories=num_t)

    @cached_property
    def _slots(self) -> torch.Tensor:
        """``[B, R]``: ``token_call`` with "no call" (-1) sent to slot ``S``, one past the calls (a gather / sum over
        every position then needs no boolean mask); computed once."""
        return torch.where(self.token_call >= 0, self.token_call, self.row.numel())

    def call_sums(self, per_token: torch.Tensor) -> torch.Tensor:
        """``[B, R]`` -> ``[S]``: each call's sum over its span (rewards: turn reward + outcome + KL penalties)."""
        out = torch.zeros(self.row.numel() + 1, dtype=torch.float64)
        out.index_add_(0, self._slots.reshape(-1), per_token.detach().cpu().double().reshape(-1))
        return out[:-1]

    def rewards(self, token_rewards: torch.Tensor, traj_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, R]`` token rewards -> ``(per call [S], per trajectory [T])`` float64: a call's reward is the sum over
        its span; a reward on no call's tokens (the outcome on a call that generated nothing) counts for its
        trajectory's last call; a trajectory's return is every reward on its rows."""
        r = token_rewards.detach().cpu().double()
        real = traj_index >= 0
        per_traj = torch.zeros(self.num_trajectories, dtype=torch.float64)
        episode = per_traj.index_add(0, traj_index[real], r.sum(-1)[real])
        stray = per_traj.index_add(0, traj_index[real], r.masked_fill(self.token_call >= 0, 0.0).sum(-1)[real])
        last = torch.zeros(self.num_trajectories, dtype=torch.long).scatter_reduce(0, self.traj, self.order, "amax")
        per_call = self.call_sums(r) + stray[self.traj] * (self.order == last[self.traj])
        return per_call, episode

    def scatter(self, per_call: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
        """``[S]`` -> ``[B, R]``: each call's value on its loss tokens, 0 elsewhere (padding rows included)."""
        out = torch.cat([per_call, per_call.new_zeros(1)])[self._slots]
        return out.to(response_mask.device) * response_mask.to(out.dtype)


def pair_ids(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[N]`` dense ids of the pairs ``(a[i], b[i])`` (int64 ``[N]`` each) in lexicographic order: what
    ``torch.unique(torch.stack([a, b], 1), dim=0, return_inverse=True)`` gives, by one sort."""
    x, y = a.detach().cpu().numpy(), b.detach().cpu().numpy()
    order = np.lexsort((y, x))
    new = np.ones(order.size, dtype=bool)
    new[1:] = (x[order][1:] != x[order][:-1]) | (y[order][1:] != y[order][:-1])
    ids = np.empty(order.size, dtype=np.int64)
    ids[order] = np.cumsum(new) - 1
    return torch.from_numpy(ids)


def _check_steps(traj_index: torch.Tensor, step_index: torch.Tensor) -> None:
    """No two real rows of one trajectory share a step (their calls' order would be ambiguous)."""
    real = torch.nonzero(traj_index >= 0).reshape(-1)
    ids = pair_ids(traj_index[real], step_index[real])
    counts = torch.bincount(ids)
    if bool((counts > 1).any()):
        dup = torch.nonzero(ids == torch.nonzero(counts > 1)[0, 0])[0, 0]  # the first repeated pair, in key order
        t, s = int(traj_index[real][dup]), int(step_index[real][dup])
        raise TrajInputError.invalid("step_index", s, f"is the step of several rows of trajectory {t}: the order of "
                                     "its calls is ambiguous", "give every row of a trajectory its own step (the "
                                     "expansion's step_index / v1's output index)")


def discounted_step_returns(calls: StepCalls, rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """``[S]`` float64: ``R_t = r_t + gamma * R_(t+1)`` along each trajectory's calls (``rewards``: per call)."""
    if not 0.0 <= float(gamma) <= 1.0:
        raise TrajInputError.invalid("algorithm.gamma", gamma, "is not in [0, 1]", "set a discount in [0, 1]")
    check_finite("rewards", rewards, "every call's reward (turn reward, outcome, KL penalty) must be finite: make "
                 "the reward function and step_rewards return finite numbers")
    if rewards.numel() == 0:
        return rewards.double()
    width = int(calls.order.max()) + 1
    table = torch.zeros(calls.num_trajectories, width + 1, dtype=torch.float64)
    table[calls.traj, calls.order] = rewards.double()
    for k in range(width - 1, -1, -1):  # over step positions, every trajectory at once
        table[:, k] += float(gamma) * table[:, k + 1]
    return table[calls.traj, calls.order]


def step_group_ids(calls: StepCalls, traj_group: np.ndarray) -> torch.Tensor:
    """``[S]`` dense ids of the step groups: calls of one GRPO group (``traj_group`` ``[T]``: each trajectory's
    uid) with equal anchor keys."""
    _, group = np.unique(np.asarray(traj_group, dtype=str), return_inverse=True)
    if calls.anchor.numel() == 0:
        return calls.anchor.clone()
    return pair_ids(torch.from_numpy(group.reshape(-1).astype(np.int64))[calls.traj], calls.anchor)


def step_group_advantages(returns: torch.Tensor, group: torch.Tensor, *, baseline: str = "gigpo",
                          norm_by_std: bool = True, epsilon: float = 1e-6) -> torch.Tensor:
    """``[S]`` step-level advantages of the calls' ``returns`` within their ``group`` (module docstring); a call
    alone in its group gets 0."""
    if baseline not in BASELINES:
        raise TrajInputError.invalid("traj.step_group_baseline", baseline, "is not a step-group baseline",
                                     f"use one of {list(BASELINES)}")
    if returns.numel() == 0:
        return returns.clone()
    n = torch.bincount(group).double()
    total = torch.zeros_like(n).index_add_(0, group, returns)
    size = n[group]
    if baseline == "leave_one_out":
        return torch.where(size > 1, returns - (total[group] - returns) / (size - 1).clamp(min=1), 0.0)
    mean = (total / n)[group]
    centred = returns - mean
    if not norm_by_std:
        return torch.where(size > 1, centred, 0.0)
    var = torch.zeros_like(n).index_add_(0, group, centred * centred)[group] / (size - 1).clamp(min=1)
    return torch.where(size > 1, centred / (var.sqrt() + epsilon), 0.0)


def combine_advantages(calls: StepCalls, episode: torch.Tensor, step: torch.Tensor, weight: float,
                       response_mask: torch.Tensor) -> torch.Tensor:
    """``[B, R]`` float32: ``episode[traj] + weight * step`` on each call's loss tokens (``episode`` ``[T]``,
    ``step`` ``[S]``); 0 on padding rows and masked positions."""
    per_call = episode.detach().cpu().double()[calls.traj] + float(weight) * step.double()
    return calls.scatter(per_call.float(), response_mask)


def step_group_metrics(calls: StepCalls, group: torch.Tensor, episode: torch.Tensor, step: torch.Tensor,
                       weight: float, response_mask: torch.Tensor, prefix: str = "traj_gigpo") -> dict[str, float]:
    """Step-group sizes (mean over groups, share of calls in groups of two or more) and the step advantage's share
    of the advantage's magnitude over loss tokens ``sum |w A_S| / sum (|A_E| + |w A_S|)``."""
    if group.numel() == 0:
        return {}
    sizes = torch.bincount(group)
    loss = calls.call_sums((response_mask.detach().cpu() != 0).double())  # [S] each call's loss tokens
    ep = (loss * episode.detach().cpu().float()[calls.traj].abs().double()).sum()
    st = (loss * (float(weight) * step.float()).abs().double()).sum()
    denom = float(ep + st)
    return {f"{prefix}/step_group_size_mean": float(sizes.double().mean()),
            f"{prefix}/steps_in_shared_groups": float((sizes[group] > 1).double().mean()),
            f"{prefix}/step_groups": float(sizes.numel()),
            f"{prefix}/step_adv_share": float(st) / denom if denom > 0 else 0.0}


def gigpo_advantages(rewards: torch.Tensor, response_mask: torch.Tensor, traj_index: torch.Tensor, step_index: Any,
                     anchors: torch.Tensor, traj_uid: np.ndarray,
                     episode_fn: Callable[[torch.Tensor, np.ndarray], torch.Tensor], *, gamma: float = 1.0,
                     weight: float = 1.0, baseline: str = "gigpo", norm_by_std: bool = True,
                     epsilon: float = 1e-6) -> tuple[torch.Tensor, dict[str, float]]:
    """GiGPO on step rows (merged or not, any order, padding rows with ``traj_index == -1``).

    Args:
        rewards: ``[B, R]`` every token reward of the rows (the outcome on the last call, turn rewards on their
            calls' last tokens, KL-in-reward penalties): a call's reward ``r_t`` is the sum over its span, a
            trajectory's return ``sum_t r_t``.
        response_mask, anchors: ``[B, R]``; traj_index, step_index: ``[B]``.
        traj_uid: ``[T]`` each trajectory's GRPO group id.
        episode_fn: ``(returns [T], traj_uid [T]) -> [T]`` the episode-level advantage (verl's GRPO, bound by the
            adapter: its normalisation and epsilon).
    Returns:
        ``(advantages [B, R] float32, metrics)``.
    """
    calls = StepCalls.build(anchors, traj_index, step_index, response_mask)
    if np.shape(traj_uid) != (calls.num_trajectories,):
        raise TrajInputError.invalid("traj_uid", traj_uid, f"has shape {np.shape(traj_uid)}, expected "
                                     f"[{calls.num_trajectories}]", "pass one GRPO uid per trajectory")
    per_call, episode = calls.rewards(rewards, check_index("traj_index", traj_index, "pass the plan's traj_index",
                                                           rows=rewards.shape[0], low=-1))
    returns = discounted_step_returns(calls, per_call, gamma)
    episode_adv = episode_fn(episode.float(), np.asarray(traj_uid, dtype=object)).detach().cpu().double()
    group = step_group_ids(calls, traj_uid)
    step = step_group_advantages(returns, group, baseline=baseline, norm_by_std=norm_by_std, epsilon=epsilon)
    advantages = combine_advantages(calls, episode_adv, step, weight, response_mask)
    return advantages, step_group_metrics(calls, group, episode_adv, step, weight, response_mask)


@register_credit_rule("gigpo", anchors=True, knobs=("step_advantage_weight", "step_group_baseline"))
def gigpo_rule(calls: CallCredit) -> CreditResult:
    """``algorithm.adv_estimator=gigpo``: :func:`gigpo_advantages` on the batch's calls, its knobs from ``traj:``
    (metrics ``traj_gigpo/*``; the returns are the advantages, as verl's GRPO)."""
    advantages, metrics = gigpo_advantages(
        calls.rewards, calls.response_mask, calls.traj_index, calls.steps, calls.anchors, calls.traj_uid,
        calls.episode_fn, gamma=calls.gamma, weight=calls.step_advantage_weight, baseline=calls.step_group_baseline,
        norm_by_std=calls.norm_by_std)
    return CreditResult(advantages, metrics=metrics)
