"""What one agent-loop session records besides its rows, for tags of its last row: the policy version and token
count of every generate attempt (:mod:`verl_traj.integration.async_modes.v1_staleness`) and its tool calls, parsed and
malformed (:class:`~verl_traj.integration.agent_loops.stepwise_agent_loop.StepwiseToolAgentLoop`).

The v1 agent-loop worker opens a ledger around each training session (:func:`session_ledger`); whatever runs inside
the session's task finds it with :func:`current_ledger` (a context variable: concurrent sessions never mix, and tasks
a session starts inherit it). Outside a session there is none, and nothing is recorded.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Iterator, Optional

from verl_traj.core.rollout.staleness import version_tokens

__all__ = ["LENGTH_TAG", "SessionLedger", "TOOL_CALLS_TAG", "VERSION_TOKENS_TAG", "current_ledger", "session_ledger"]

VERSION_TOKENS_TAG = "traj_version_tokens"  # [[version, tokens], ...]: the session's generated tokens per version
TOOL_CALLS_TAG = "traj_tool_calls"  # [parsed, malformed]: the session's tool calls
LENGTH_TAG = "traj_length"  # [generated tokens, LLM calls]: the session's length (traj_bias/*)


@dataclass
class SessionLedger:
    """One session's agent loop (its registered name, for messages), generate attempts ``(version, tokens)``, LLM
    calls (an aborted call resumed under new weights is one call of several attempts), tool-call counts and the keys
    of the rows it stored (a failed session clears exactly those:
    :func:`~verl_traj.integration.async_modes.v1_failures.run_session`)."""

    agent_name: Optional[str] = None
    attempts: list = field(default_factory=list)
    calls: int = 0
    tool_calls: int = 0
    malformed_tool_calls: int = 0
    stored_keys: list = field(default_factory=list)  # the row keys its worker stores, each recorded before its put

    def tags(self) -> dict:
        """The last row's tags: :data:`VERSION_TOKENS_TAG` when attempts were recorded and the server reported the
        version of every one that generated tokens (``traj.max_staleness`` refuses rows without it: a loop whose calls
        bypass the recorder must not pass for fresh), :data:`TOOL_CALLS_TAG` when the loop parsed tool calls."""
        known = bool(self.attempts) and all(v is not None or n <= 0 for v, n in self.attempts)
        out = {VERSION_TOKENS_TAG: version_tokens(self.attempts)} if known else {}
        if self.tool_calls or self.malformed_tool_calls:
            out[TOOL_CALLS_TAG] = [self.tool_calls, self.malformed_tool_calls]
        if self.calls:
            out[LENGTH_TAG] = self.length()
        return out

    def length(self) -> list[int]:
        """``[generated tokens, LLM calls]`` so far (:data:`LENGTH_TAG`)."""
        return [sum(int(n) for _, n in self.attempts if n > 0), int(self.calls)]

    def fill_version_fields(self, extra_fields: dict) -> None:
        """verl's v1 trainer reads every row's ``min_global_steps`` / ``max_global_steps`` (the first and last policy
        version of its tokens) from the loop's ``extra_fields``; verl's own loops copy them from the server's output,
        a loop of one's own may not. Filled from the recorded attempts where missing."""
        versions = [v for v, n in self.attempts if v is not None]
        for key, value in (("min_global_steps", min(versions, default=None)),
                           ("max_global_steps", max(versions, default=None))):
            if extra_fields.get(key) is None and value is not None:
                extra_fields[key] = value


_LEDGER: contextvars.ContextVar[Optional[SessionLedger]] = contextvars.ContextVar("verl_traj_session_ledger",
                                                                                  default=None)


@contextlib.contextmanager
def session_ledger(agent_name: Optional[str] = None) -> Iterator[SessionLedger]:
    """A fresh ledger for the session run inside (``agent_name``: its agent loop's registered name)."""
    ledger = SessionLedger(agent_name=agent_name)
    token = _LEDGER.set(ledger)
    try:
        yield ledger
    finally:
        _LEDGER.reset(token)


def current_ledger() -> Optional[SessionLedger]:
    """The running session's ledger, or ``None`` outside one."""
    return _LEDGER.get()
