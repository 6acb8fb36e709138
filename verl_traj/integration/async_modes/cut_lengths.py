"""The lengths of the trajectories a step does not train, by cause, read where the replay buffer lets them go
(issue 43, item 1): the trainer sets them against what it trains (:func:`~verl_traj.core.rollout.length_bias.bias_metrics`,
``traj_bias/*``).

Causes: ``stale`` (a group over ``traj.max_staleness``, every trajectory of it), ``failed`` / ``timeout`` (a session
that raised, or passed ``traj.trajectory_timeout_s``: its length when it stopped, from its failure tag),
``failed_group`` (a finished session of a group dropped for a failed sibling, ``traj.failed_groups=drop``). A
finished session's length is its last row's :data:`~verl_traj.core.rollout.session_ledger.LENGTH_TAG`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Mapping

from verl_traj.core.rollout.failures import CUT_LENGTH_PREFIX, FAILURE_TAG_PREFIX
from verl_traj.core.rollout.length_bias import Lengths

__all__ = ["CutLengths", "finished_lengths", "failed_lengths"]


def finished_lengths(group_lengths: Mapping[str, Iterable],
                     groups_by_cause: Mapping[str, Iterable[str]]) -> dict[str, list]:
    """Per cause, ``[[tokens, calls], ...]`` of the finished sessions of its groups (``group_lengths``: uid -> the
    lengths its rows carry, a session's last row carrying its :data:`~verl_traj.core.rollout.session_ledger.LENGTH_TAG`;
    :class:`~verl_traj.integration.async_modes.group_index.GroupIndex`). Work per group let go, not per row stored."""
    out: dict[str, list] = defaultdict(list)
    for cause, uids in groups_by_cause.items():
        for uid in uids:
            out[cause].extend(list(length) for length in group_lengths.get(uid, ()))
    return {cause: lengths for cause, lengths in out.items() if lengths}


def failed_lengths(prompt_tags: Mapping[str, Mapping], uids: Iterable[str]) -> dict[str, list[list[int]]]:
    """``{"timeout" | "failed": [[tokens, calls], ...]}`` of the failed sessions of groups ``uids``, from their
    prompt keys' tags (a session without a recorded length generated nothing: 0 tokens, 0 calls)."""
    out: dict[str, list[list[int]]] = defaultdict(list)
    for uid in uids:
        tag = prompt_tags.get(uid) or {}
        for key, reason in tag.items():
            if key.startswith(FAILURE_TAG_PREFIX):
                session = key[len(FAILURE_TAG_PREFIX):]
                length = tag.get(f"{CUT_LENGTH_PREFIX}{session}", [0, 0])
                out["timeout" if reason == "timeout" else "failed"].append(list(length))
    return dict(out)


class CutLengths:
    """What the buffer let go since the trainer last asked, by cause (constant work per group let go)."""

    def __init__(self) -> None:
        self.by_cause: dict[str, list[list[int]]] = defaultdict(list)

    def add(self, cause: str, lengths: Iterable[list[int]]) -> None:
        self.by_cause[cause].extend(lengths)

    def take(self) -> dict[str, Lengths]:
        """Every cause's lengths (:class:`~verl_traj.core.rollout.length_bias.Lengths`), and forget them."""
        out = {cause: Lengths.of([t for t, _ in v], [c for _, c in v]) for cause, v in self.by_cause.items()}
        self.by_cause = defaultdict(list)
        return out
