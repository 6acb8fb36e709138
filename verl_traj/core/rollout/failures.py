"""Failed rollouts, handled per GRPO group (``traj.failed_groups``): which failed groups leave the batch, and what is
logged about them. Pure: no verl, no TransferQueue; :mod:`verl_traj.integration.async_modes.v1_failures` applies it to
verl's replay buffer, whose unit is the group (a prompt ``uid`` and its ``n`` sessions).

A session (one trajectory) fails when its agent loop raises: an error in the loop or a tool it does not catch, a
context overflow the loop reports by raising, or ``traj.trajectory_timeout_s`` passing. verl marks the group
``failure`` once every session has settled; the failed session wrote no rows (verl_traj clears any it had written),
its siblings did. Policies:

* ``drop`` (default): the whole group leaves the batch and a fresh prompt replaces it. The advantage baseline is
  never computed over a group that lost members, and a failure that correlates with the task (a hard task times out)
  cannot bias the batch toward the survivors' outcomes.
* ``keep_survivors``: a group with at least two finished sessions trains on the survivors, its baseline over them
  (GRPO with a smaller n: verl's estimators group by ``uid``, so a group of ``k`` survivors gets exactly the
  advantages of a group sampled with ``n = k``); a group with fewer is dropped and replaced: one survivor has no
  baseline but itself (verl would hand it its raw score as its advantage: mean 0, std 1, the ``n = 1`` rule), so it
  carries no group-relative signal. Groups sampled with ``n = 1`` keep their one. Logged apart, so a shrunken group
  is never silent.

verl 0.9.1's own behaviour, for comparison: the sync trainer keeps every failed group's survivors (the baseline over
them, unlogged); its async trainers drop every failed group.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Iterable, Mapping, Optional

from verl_traj.core.errors import TrajInputError

__all__ = ["CUT_LENGTH_PREFIX", "FAILED_GROUP_POLICIES", "FAILURE_TAG_PREFIX", "FATAL_TAG", "failed_groups_to_evict", "fatal_failure",
           "failure_metrics", "min_survivors",
           "failure_reason", "failure_tag"]

FAILED_GROUP_POLICIES = ("drop", "keep_survivors")
FATAL_TAG = "traj_fatal"  # a failed session's verl_traj refusal (message): stops training
FAILURE_TAG_PREFIX = "traj_failure_"  # + session id: the tag of a group's prompt key naming why that session failed
CUT_LENGTH_PREFIX = "traj_cut_length_"  # + session id: a failed session's [generated tokens, LLM calls] so far


def failure_reason(error: BaseException) -> str:
    """A short label for why a session failed: ``timeout`` for a deadline, else the exception's class name."""
    if isinstance(error, (asyncio.TimeoutError, TimeoutError)):
        return "timeout"
    return type(error).__name__


def failure_tag(session_id: int, error: BaseException, length: Optional[list] = None) -> dict:
    """The tag a failed session adds to its group's prompt key (one field per session: concurrent sessions of a group
    write different fields, and TransferQueue merges a key's tags). A verl_traj refusal of the loop's contract
    (a :class:`TrajInputError` raised with ``every_rollout=True``: every rollout would break it the same way) also
    carries its message under :data:`FATAL_TAG`: dropping and refilling would only repeat it. A refusal of one
    rollout's data (a NaN log-prob) fails that group only. ``length``: the session's ``[generated tokens, LLM calls]``
    when it failed (:data:`CUT_LENGTH_PREFIX`: the length bias of dropping it, ``traj_bias/*``)."""
    tag = {f"{FAILURE_TAG_PREFIX}{int(session_id)}": failure_reason(error)}
    if length is not None:
        tag[f"{CUT_LENGTH_PREFIX}{int(session_id)}"] = [int(x) for x in length]
    if isinstance(error, TrajInputError) and error.every_rollout:
        tag[FATAL_TAG] = f"{type(error).__name__}: {error}"
    return tag


def fatal_failure(prompt_tags: Mapping[str, Mapping]) -> None:
    """Raise the first verl_traj refusal a failed session recorded (:data:`FATAL_TAG`) in the trainer, so a loop that
    records something wrong stops training with its message instead of being dropped and refilled for ever."""
    for uid, tag in prompt_tags.items():
        if FATAL_TAG in (tag or {}):
            raise TrajInputError(f"a rollout of group {uid!r} was refused by verl_traj, and every rollout would be: "
                                 f"{tag[FATAL_TAG]}", field="agent loop")


def min_survivors(group_size: int) -> int:
    """The fewest finished sessions a failed group trains on under ``keep_survivors``: 2 for groups sampled with
    ``n > 1`` (a baseline over the survivors needs another), 1 for ``n = 1``."""
    return 2 if group_size > 1 else 1


def failed_groups_to_evict(failed: set[str], survivors: Mapping[str, int], policy: str, least: int = 1) -> set[str]:
    """The failed groups (``uid``) that leave the batch: all of them (``drop``), or those with fewer than ``least``
    finished sessions (``keep_survivors``, :func:`min_survivors`). ``survivors``: finished sessions per group (a
    group absent has none)."""
    if policy == "drop":
        return set(failed)
    if policy == "keep_survivors":
        return {uid for uid in failed if survivors.get(uid, 0) < least}
    raise ValueError(f"unknown failed-group policy {policy!r}; expected one of {FAILED_GROUP_POLICIES}")


def failure_metrics(prompt_tags: Mapping[str, Mapping], dropped: Iterable[str], kept: Iterable[str]) -> dict[str, float]:
    """``traj_failure/*`` for the failed groups handled in one sampling: ``groups_dropped_total``, ``groups_kept_total``
    (trained on their survivors), ``trajectories_failed_total`` (failed sessions of both) and ``reason_total/<label>``
    per failed session (counts: verl's v1 metric aggregation sums a name with ``total`` over a step's local updates).
    ``prompt_tags``: each group's prompt-key tags (the :func:`failure_tag` fields)."""
    dropped, kept = list(dropped), list(kept)
    reasons = Counter(value for uid in dropped + kept for key, value in (prompt_tags.get(uid) or {}).items()
                      if key.startswith(FAILURE_TAG_PREFIX))
    out = {"traj_failure/groups_dropped_total": float(len(dropped)), "traj_failure/groups_kept_total": float(len(kept)),
           "traj_failure/trajectories_failed_total": float(sum(reasons.values()))}
    out.update({f"traj_failure/reason_total/{reason}": float(count) for reason, count in reasons.items()})
    return out
