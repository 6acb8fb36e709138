"""v1's TransferQueue row key ``{uid}_{session}_{index}``: the one codec, written by the agent loop
(:mod:`verl_traj.integration.agent_loops.v1_agent_loop`, verl's ``AgentLoopWorkerTQ`` format) and read by the trainer
(:mod:`verl_traj.integration.trainers.v1`).

``uid`` is the prompt (the GRPO group; it may itself contain ``_``), ``{uid}_{session}`` one trajectory (one of
``rollout.n`` sessions of the prompt), ``index`` the row's position among the session's outputs: its step.

Pure module (numpy and stdlib).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from verl_traj.core.errors import TrajInputError

__all__ = ["RowKeys", "parse_row_keys", "row_key", "row_key_order", "session_key_prefix"]


def row_key(uid: Any, session: int, index: int) -> str:
    """The key of step ``index`` of session ``session`` of prompt ``uid``."""
    return f"{session_key_prefix(uid, session)}{int(index)}"


def session_key_prefix(uid: Any, session: int) -> str:
    """What every row key of session ``session`` of prompt ``uid`` starts with (and no other session's: the session
    is followed by the separator)."""
    return f"{uid}_{int(session)}_"


@dataclass(frozen=True)
class RowKeys:
    """The parsed keys of a batch, ``[B]`` each: ``uid`` and ``traj_id`` (object), ``step`` (int64)."""

    uid: np.ndarray
    traj_id: np.ndarray
    step: np.ndarray


def _split(key: str) -> list[str]:
    parts = key.rsplit("_", 2) if isinstance(key, str) else []
    if len(parts) != 3 or not parts[0] or not parts[1].isdigit() or not parts[2].isdigit():
        raise TrajInputError.invalid(
            "row key", key, "is not '{uid}_{session}_{index}' (verl's AgentLoopWorkerTQ key; session and index "
            "are integers): verl_traj reads the prompt group, trajectory and step from it",
            "store rows with verl's v1 agent-loop worker (or a subclass that keeps its key format), or set "
            "traj.enable=false")
    return parts


def parse_row_keys(keys: Sequence[str]) -> RowKeys:
    """``RowKeys`` of ``keys``; a key of another format is refused (:class:`TrajInputError`, field ``row key``)."""
    parts = [_split(k) for k in keys]
    uid = np.array([p[0] for p in parts], dtype=object)
    traj = np.array([f"{p[0]}_{p[1]}" for p in parts], dtype=object)
    return RowKeys(uid=uid, traj_id=traj, step=np.array([int(p[2]) for p in parts], dtype=np.int64))


def row_key_order(key: str) -> tuple[str, int, int]:
    """Sort key: prompt, then session and step as numbers (``_10`` after ``_9``)."""
    uid, session, index = _split(key)
    return uid, int(session), int(index)
