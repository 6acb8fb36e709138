"""Staleness per trajectory, in tokens per policy version (``traj.max_staleness``, ``traj.stale_groups``). Pure: numpy
and stdlib; :mod:`verl_traj.integration.async_modes.v1_staleness` records the versions and applies the bound to verl's
replay buffer, whose unit is the GRPO group.

A trajectory's tokens can come from several policies: a partial rollout is aborted at each weight sync and resumed
under the new weights, and a long agent's later turns are generated after syncs its first turns did not see. Every
generate attempt reports the policy version it ran under (verl's ``extra_fields["global_steps"]``) and its token
count; a trajectory's **version tokens** are those counts summed per version, ``[[version, tokens], ...]`` ascending.

Staleness is measured against the policy being trained: at training step ``g`` verl's actor holds version ``g - 1``
(verl's own convention: ``training/off_policy/trajectory_staleness = (g - 1) - max_global_steps``). A trajectory's
**token staleness** is the token-weighted mean of ``(g - 1) - version`` over the tokens it generated: 0 when every
token came from the trained policy, 2.0 when all came from the policy two updates back, 0.5 when half of them did
and half are current. verl's own bound counts versions since the prompt was dispatched, whatever share of the tokens
they produced; a partial rollout with a few old tokens and many new ones is not stale by this measure.

The bound (``traj.max_staleness``, ``None`` = none) holds per trajectory and acts on its whole group, never on part:

* ``drop`` (default): a finished group with a trajectory over the bound leaves the batch, and a fresh prompt replaces
  it (verl's refill);
* ``defer``: the trainer does not move to the next step while a running group could pass the bound there
  (:func:`groups_to_defer`: dispatched at step ``d``, its first tokens come from version ``d - 1``; at step ``g + 1``
  they would be ``g - d + 1`` behind); the group finishes first and trains within the bound. A finished group over the
  bound anyway (a backlog the trainer had no room for, or a rollout pool lagging more than one version) is dropped:
  the bound holds under both policies, ``defer`` only trades waiting for dropping.
* ``correct``: a group over the bound trains, its stale tokens weighted by verl's rollout correction
  (``algorithm.rollout_correction.rollout_is=token``: the importance weight of the trained policy's old log-probs
  against the rollout's, truncated at ``rollout_is_threshold``), which start-up requires; no token trains past the
  hard lag cap ``traj.max_lag``, and a health gate hands over to a fallback where the weights degrade
  (:mod:`verl_traj.core.rollout.offpolicy`). The bound is where the correction takes over, and past it each group is counted.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np

from verl_traj.core.errors import TrajInputError

__all__ = ["STALE_GROUP_POLICIES", "VersionTokens", "check_bound", "groups_over_bound", "groups_to_defer", "stalest",
           "staleness_of", "token_staleness", "token_staleness_metrics", "version_tokens"]

STALE_GROUP_POLICIES = ("drop", "defer", "correct")
VersionTokens = Sequence[Sequence[int]]  # [[version, tokens], ...]: one trajectory's generated tokens per version


def version_tokens(attempts: Iterable[tuple[Optional[int], int]]) -> list[list[int]]:
    """``[[version, tokens], ...]`` (ascending versions, tokens > 0) of a trajectory's generate attempts, each
    ``(version, tokens generated)``. An attempt that generated tokens without a version is refused: the server did
    not report the policy it sampled from."""
    totals: dict[int, int] = defaultdict(int)
    for version, tokens in attempts:
        if tokens <= 0:
            continue
        if version is None or isinstance(version, bool) or not isinstance(version, (int, np.integer)):
            raise TrajInputError.invalid(
                "extra_fields['global_steps']", version,
                f"is not a policy version, for a generate call that produced {tokens} tokens: verl_traj measures "
                "staleness per token from the version each rollout server reports",
                "use a rollout server that reports global_steps (verl's vLLM, SGLang and the CPU server do), or "
                "unset traj.max_staleness")
        totals[int(version)] += int(tokens)
    return [[v, totals[v]] for v in sorted(totals)]


def flat_version_tokens(ledgers: Sequence[VersionTokens]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(trajectory index, version, tokens)`` of every ``[version, tokens]`` pair, ``[P]`` int64 each."""
    counts = np.array([len(ledger) for ledger in ledgers], dtype=np.int64)
    pairs = np.array([pair for ledger in ledgers for pair in ledger], dtype=np.int64).reshape(-1, 2)
    return np.repeat(np.arange(len(ledgers)), counts), pairs[:, 0], pairs[:, 1]


def token_staleness(ledgers: Sequence[VersionTokens], trained_version: int) -> tuple[np.ndarray, np.ndarray]:
    """``([T] float64 token staleness, [T] int64 tokens)`` of ``T`` trajectories against ``trained_version``. A
    trajectory that generated no token has staleness 0."""
    index, version, tokens = flat_version_tokens(ledgers)
    total = np.bincount(index, weights=tokens, minlength=len(ledgers))
    behind = np.bincount(index, weights=tokens * (trained_version - version), minlength=len(ledgers))
    staleness = np.divide(behind, total, out=np.zeros(len(ledgers)), where=total > 0)
    return staleness, total.astype(np.int64)


def stalest(ledgers: Sequence[VersionTokens]) -> tuple[int, int]:
    """``(tokens, sum of version x tokens)`` of the trajectory with the lowest token-weighted mean version among
    ``ledgers`` (compared exactly, as fractions), ``(0, 0)`` where none generated a token. It is the group's stalest
    against every trained version (staleness is ``trained - mean version``), so a finished group's bound check is
    learnt once (:func:`staleness_of`), whatever the step."""
    best = (0, 0)
    for ledger in ledgers:
        tokens = sum(int(n) for _, n in ledger)
        weighted = sum(int(v) * int(n) for v, n in ledger)
        if tokens and (not best[0] or weighted * best[0] < best[1] * tokens):
            best = (tokens, weighted)
    return best


def staleness_of(stalest_pair: tuple[int, int], trained_version: int) -> float:
    """The token staleness of :func:`stalest`'s trajectory against ``trained_version``: its tokens' lags summed
    exactly (integers), over their count; 0 for no token."""
    tokens, weighted = stalest_pair
    return (trained_version * tokens - weighted) / tokens if tokens else 0.0


def groups_over_bound(ledgers: Mapping[str, Sequence[VersionTokens]], trained_version: int,
                      bound: float) -> set[str]:
    """The groups (``uid`` -> its trajectories' version tokens) with a trajectory whose token staleness against
    ``trained_version`` exceeds ``bound``."""
    return {uid for uid, group in ledgers.items() if staleness_of(stalest(group), trained_version) > bound}


def groups_to_defer(dispatch_steps: Mapping[str, int], global_steps: int, bound: float) -> set[str]:
    """Running groups (``uid`` -> the training step it was dispatched at) the trainer waits for before leaving step
    ``global_steps``: their first tokens (version ``dispatch - 1``) would be ``global_steps - dispatch + 1`` versions
    behind the policy of the next step, more than ``bound``."""
    return {uid for uid, step in dispatch_steps.items() if global_steps - int(step) + 1 > bound}


def token_staleness_metrics(ledgers: Sequence[VersionTokens], trained_version: int) -> dict[str, float]:
    """``traj_version/*`` in tokens, over ``T`` trajectories: ``token_staleness_mean`` (over every generated token),
    ``token_staleness_max`` (the stalest trajectory's token staleness) and ``current_policy_token_share`` (the share
    of generated tokens that came from the trained policy). Empty for no trajectory."""
    if not ledgers:
        return {}
    staleness, total = token_staleness(ledgers, trained_version)
    _, version, tokens = flat_version_tokens(ledgers)
    generated = max(int(total.sum()), 1)
    return {"traj_version/token_staleness_mean": float((staleness * total).sum() / generated),
            "traj_version/token_staleness_max": float(staleness.max()),
            "traj_version/current_policy_token_share": float(tokens[version == trained_version].sum() / generated)}


def check_bound(bound: Optional[float], field: str = "traj.max_staleness", error: type = TrajInputError) -> None:
    """``bound``: ``None`` or a finite number >= 1 (policy versions), else ``error`` (a :class:`TrajInputError`
    subclass) naming it. Below 1, ``defer`` would wait for the groups dispatched in the current step too, which the
    rollout keeps replacing (it would wait for ever), and ``drop`` would evict every group not generated entirely
    after the last weight sync."""
    if bound is None:
        return
    if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not math.isfinite(bound) or bound < 1:
        raise error.invalid(
            field, bound, "is not a staleness bound: the most a trajectory's token staleness (the token-weighted "
            "mean of how many policy versions each token is behind the policy being trained) may be when it trains, "
            "at least 1 (below, defer would wait for ever)", "set a number >= 1 (1: on "
            "average at most one update behind; 2.5: two and a half), or null for no bound")
