"""Credit on a batch of branching sessions (issue 56): outcome estimators over the leaves, Tree-GRPO, and each call's
share under the two weightings, as tensor work over the step rows (no loop over rows, calls or leaves).

The rows carry each call's packed leaf span on its first response token
(:data:`~verl_traj.core.keys.TREE_CALLS`, :func:`~verl_traj.stepwise.call_tree.pack_leaf_span`): a session's leaves
are numbered depth-first, so call ``c``'s leaves ``L(c)`` are ``lo_c .. hi_c - 1``. A chain's session (rows without
a span) is one leaf, ``(0, 1)`` for every call. The batch's leaves are numbered session after session
(``offset[t] + lo``), so every per-call sum over ``L(c)`` is a difference of one prefix sum.

* **Leaf outcomes** ``G_l``: the leaf's own outcome (:data:`~verl_traj.core.keys.TREE_OUTCOMES`, where the agent loop
  gave one) else the session's outcome (its last row's token rewards).
* **Leaf advantages** ``A_l``: an outcome estimator (GRPO, RLOO, ...) over the leaves of every session of a prompt
  (the group is the sessions' ``uid``); Tree-GRPO adds the leaf's normalised outcome within its own session.
* **A call's parts** ``P_c = sum of the positive A_l``, ``N_c = sum of the negative A_l`` over ``L(c)``;
  the rows carry both divided by ``m_c = hi_c - lo_c`` and the call trains with ``loss(r, P_c / m_c) +
  loss(r, N_c / m_c)``: its ``m_c`` root-to-leaf copies each weighted ``1 / m_c`` under PPO's clipping (``once``, the
  default: each distinct token once). ``expanded`` also weighs each token by ``m_c`` (:attr:`TreeCredit.copies`), in
  the loss and in its normaliser's token count: the copies themselves (docs/branching.md). The rows' ``advantages``
  hold ``(P_c + N_c) / m_c``, the mean of ``A_l``, and :attr:`TreeCredit.negative` holds ``N_c / m_c`` where a call
  has leaves of both signs (0 elsewhere), so the loss evaluates ``advantages - negative`` and ``negative``.
  ``paths`` (what the peers train, for comparison): the rows are each root-to-leaf path's own, every copy of a call
  spans its path's leaf alone (``m = 1``): the loss and gradient of ``expanded``, each shared token forwarded per
  path.

On a batch of chains every session is one leaf, ``A_l`` is the estimator's per-trajectory value and every call gets
it: today's advantages. Pure module (torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from verl_traj.core.plan.estimators import BRANCH_WEIGHTINGS
from verl_traj.stepwise.call_tree import pack_leaf_span, unpack_leaf_span
from verl_traj.stepwise.credit_rules import CallCredit, CreditResult, register_credit_rule
from verl_traj.stepwise.inputs import StepwiseAdvantageError

__all__ = ["TreeCredit", "WEIGHTINGS", "call_leaf_spans", "session_normalised", "tree_credit", "tree_grpo"]

WEIGHTINGS = BRANCH_WEIGHTINGS  # traj.branch_weighting


@dataclass(frozen=True)
class TreeCredit:
    """``advantages`` ``[B, R]`` (``(P + N) / m`` of each token's call, 0 off the loss tokens and on padding rows),
    ``negative`` ``[B, R]`` (``N / m`` where the call's leaves have both signs, else 0), ``leaf_advantages`` ``[L]``,
    ``num_leaves`` ``[T]``, ``copies`` ``[B, R]`` (``expanded``: each loss token's ``m``, else ``None``),
    ``leaf_outcomes`` ``[L]``."""

    advantages: torch.Tensor
    negative: torch.Tensor
    leaf_advantages: torch.Tensor
    num_leaves: torch.Tensor
    copies: Optional[torch.Tensor] = None
    leaf_outcomes: Optional[torch.Tensor] = None

    def metrics(self) -> dict[str, float]:
        """``traj_tree/*``: leaves per session (mean, max), the leaves' mean outcome (what a branching agent's reward
        curve reads) and the loss tokens with a two-sign split."""
        n = self.num_leaves.to(torch.float64)
        out = {"traj_tree/leaves_mean": float(n.mean()) if n.numel() else 0.0,
               "traj_tree/leaves_max": float(n.max()) if n.numel() else 0.0,
               "traj_tree/split_tokens": float((self.negative != 0).sum())}
        if self.leaf_outcomes is not None and self.leaf_outcomes.numel():
            out["traj_tree/leaf_outcome_mean"] = float(self.leaf_outcomes.mean())
        return out


def call_leaf_spans(tree_calls: torch.Tensor, traj_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(lo [B, R], hi [B, R], num_leaves [T])``: the leaf span of the call each response position belongs to (the
    last call started at or before it on its row; ``(0, 1)`` on a row without spans) and each session's leaf count
    (its largest ``hi``, at least 1)."""
    B, R = tree_calls.shape
    marked = tree_calls != 0
    at = torch.where(marked, torch.arange(R, device=tree_calls.device).expand(B, R), -1).cummax(dim=1).values
    key = torch.where(at >= 0, tree_calls.gather(1, at.clamp(min=0)), pack_leaf_span(0, 1, 0).item())
    lo, hi, _ = unpack_leaf_span(key)
    real = traj_index >= 0
    T = int(traj_index.max()) + 1 if bool(real.any()) else 0
    leaves = torch.ones(T, dtype=torch.long, device=tree_calls.device)
    rows = traj_index.clamp(min=0)[:, None].expand(B, R)
    leaves.scatter_reduce_(0, rows[real].reshape(-1), hi[real].reshape(-1), reduce="amax")
    return lo, hi, leaves


def session_normalised(values: torch.Tensor, group: torch.Tensor, num_groups: int, norm_by_std: bool,
                       eps: float = 1e-6) -> torch.Tensor:
    """``[L]`` ``(v - mean) / (std + eps)`` within each ``group`` (``[L]`` ints ``0..num_groups-1``), ``std``
    unbiased and 0 for a group of one, as verl's GRPO takes it; ``norm_by_std=False``: ``v - mean``."""
    v = values.to(torch.float64)
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, torch.ones_like(v))
    mean = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, v) / count.clamp(min=1)
    centred = v - mean[group]
    if not norm_by_std:
        return centred
    square = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, centred ** 2)
    std = torch.where(count > 1, (square / (count - 1).clamp(min=1)).sqrt(), torch.zeros_like(count))
    return centred / (std[group] + eps)


def _leaf_outcomes(session_score: torch.Tensor, tree_calls: torch.Tensor, tree_outcomes: torch.Tensor,
                   traj_index: torch.Tensor, offset: torch.Tensor, num_leaves: torch.Tensor) -> torch.Tensor:
    """``[L]`` float64 each leaf's outcome: its own where a call's span carries the own bit, else its session's."""
    G = torch.repeat_interleave(session_score.to(torch.float64), num_leaves)
    lo, _, own = unpack_leaf_span(tree_calls)
    pick = (own == 1) & (traj_index >= 0)[:, None]
    leaf = offset[traj_index.clamp(min=0)][:, None].expand_as(lo)[pick] + lo[pick]
    G[leaf] = tree_outcomes[pick].to(torch.float64)
    return G


def tree_credit(session_score: torch.Tensor, response_mask: torch.Tensor, traj_index: torch.Tensor,
                tree_calls: torch.Tensor, tree_outcomes: torch.Tensor, traj_group: np.ndarray,
                leaf_estimator: Callable[[torch.Tensor, np.ndarray], torch.Tensor], *, session_term: bool = False,
                norm_by_std: bool = True, weighting: str = "once") -> TreeCredit:
    """The advantages of a planned batch of step rows some of whose sessions branch (module docstring).

    ``session_score`` ``[T]``: each session's outcome; ``response_mask`` / ``tree_calls`` / ``tree_outcomes``
    ``[B, R]``; ``traj_index`` ``[B]`` (``-1`` on padding rows); ``traj_group`` ``[T]`` each session's GRPO id;
    ``leaf_estimator(outcomes [L], group [L]) -> [L]``: the outcome estimator over leaves; ``session_term``: Tree-GRPO's
    within-session term; ``weighting``: ``traj.branch_weighting``."""
    if weighting not in WEIGHTINGS:
        raise StepwiseAdvantageError.invalid("traj.branch_weighting", weighting, f"is not one of {list(WEIGHTINGS)}",
                                             "set once (each distinct token once), expanded (as one row per "
                                             "root-to-leaf path) or paths (one row per path, forwarded so)")
    traj = traj_index.to(torch.long).cpu()
    tree_calls = torch.where((traj >= 0)[:, None], tree_calls.to(torch.long).cpu(), 0)  # padding rows: no span
    lo, hi, num_leaves = call_leaf_spans(tree_calls, traj)
    offset = torch.cumsum(num_leaves, 0) - num_leaves
    G = _leaf_outcomes(session_score.cpu(), tree_calls, tree_outcomes.cpu(), traj, offset, num_leaves)
    leaf_session = torch.repeat_interleave(torch.arange(num_leaves.numel()), num_leaves)
    A = leaf_estimator(G, np.asarray(traj_group, dtype=object)[leaf_session.numpy()]).to(torch.float64)
    if session_term:
        A = A + session_normalised(G, leaf_session, num_leaves.numel(), norm_by_std)
    zero = torch.zeros(1, dtype=torch.float64)
    up, down = torch.cat([zero, A.clamp(min=0).cumsum(0)]), torch.cat([zero, A.clamp(max=0).cumsum(0)])
    base = offset[traj.clamp(min=0)][:, None]
    one = hi - lo == 1  # a call above one leaf takes that leaf's value itself (a chain's calls: bit for bit)
    at = (base + lo).clamp(max=max(A.numel() - 1, 0))
    P = torch.where(one, A.clamp(min=0)[at], up[base + hi] - up[base + lo])
    N = torch.where(one, A.clamp(max=0)[at], down[base + hi] - down[base + lo])
    m = (hi - lo).clamp(min=1).to(torch.float64)
    P, N = P / m, N / m
    keep = response_mask.cpu().to(torch.float64) * (traj >= 0)[:, None]
    dtype, device = torch.float32, response_mask.device
    advantages = ((P + N) * keep).to(dtype)
    negative = torch.where((P > 0) & (N < 0), N, torch.zeros_like(N)) * keep
    copies = (m * keep).to(dtype).to(device) if weighting == "expanded" else None
    return TreeCredit(advantages.to(device), negative.to(dtype).to(device), A.to(dtype), num_leaves, copies, G)


def _session_scores(calls: CallCredit) -> torch.Tensor:
    """``[T]`` each session's outcome: the sum of its rows' token rewards (the outcome sits on its last row; turn
    rewards and KL-in-reward are refused on a batch with trees)."""
    traj = calls.traj_index.to(torch.long).cpu()
    real = traj >= 0
    per_row = calls.rewards.detach().cpu().to(torch.float64).sum(-1)
    return torch.zeros(len(calls.traj_uid), dtype=torch.float64).index_add_(0, traj[real], per_row[real])


@register_credit_rule("tree_grpo", trees=True)
def tree_grpo(calls: CallCredit) -> CreditResult:
    """Tree-GRPO (arXiv 2509.21240) on step rows: each leaf's advantage is its outcome normalised over the leaves of
    every session of its prompt (verl's GRPO, ``algorithm.norm_adv_by_std_in_grpo``) plus normalised over its own
    session's leaves; each call trains with its leaves' parts under ``traj.branch_weighting`` (module docstring). On
    sessions that do not branch (one leaf each) the second term is 0: GRPO."""
    zeros = torch.zeros(calls.response_mask.shape, dtype=torch.long)
    tree_calls = calls.tree_calls if calls.tree_calls is not None else zeros
    outcomes = calls.tree_outcomes if calls.tree_outcomes is not None else zeros.float()
    credit = tree_credit(_session_scores(calls), calls.response_mask, calls.traj_index, tree_calls, outcomes,
                         calls.traj_uid, calls.episode_fn, session_term=True, norm_by_std=calls.norm_by_std,
                         weighting=calls.branch_weighting)
    return CreditResult(credit.advantages, metrics=credit.metrics(), negative=credit.negative, copies=credit.copies)
