"""Recording a session whose LLM calls branch (issue 56, item 1): each recorded call names its parent.

A call's parent is the previous call *on its branch*: the last call recorded in the same asyncio context. The branch
is that context, a ``contextvars.ContextVar`` holding the index of the branch's last call:

* **a chain** (one coroutine calling the model in turn): every call's parent is the call before it, as today
  (:func:`~verl_traj.stepwise.records.encode_step_records` then names no parent);
* **forks** (best-of-N from a mid-state, tree search): start the branches as asyncio tasks
  (``asyncio.gather(*(self.rollout_branch(...) for _ in range(n)))``, ``asyncio.create_task``). A task copies the
  context it is created in, so each branch continues from the call the session had reached when it was started,
  whatever order the branches finish in. The session's own context continues from the fork point afterwards;
* **a sub-agent in its own context** (:func:`fresh_context`): calls inside start a fresh context (the first one's
  parent is -1) and chain among themselves; after the block the outer branch continues where it was. Sub-agents run
  concurrently as tasks created inside the block are recorded each on its own branch;
* **a condensation or context reset** (:func:`condense`): the next call on this branch starts a fresh context.

Records are appended in completion order. A parent is always recorded before its children (a child is issued after
its parent's response), so every parent index is smaller than its child's: the invariant
:func:`~verl_traj.stepwise.records.call_parent` checks. :func:`truncate_calls` clips the calls to the row budget, a
tree as a chain: a call whose prompt alone reaches the budget is dropped with every call below it (on a chain, every
later call), and the parents of the calls kept are renumbered.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Optional, Sequence

from verl_traj.stepwise.expand import StepExpansionError

__all__ = ["begin_session", "condense", "end_session", "fresh_context", "leaves", "record_call", "truncate_calls",
           "with_leaf_outcomes"]

FRESH = -1  # no parent: the call starts a fresh context
# the index of the last call recorded on this branch (this asyncio context), FRESH before the first
_LAST_CALL: contextvars.ContextVar[int] = contextvars.ContextVar("traj_branch_last_call", default=FRESH)


def begin_session() -> contextvars.Token:
    """Start a session's recording in this context (its first call starts a fresh context); returns the token
    :func:`end_session` restores."""
    return _LAST_CALL.set(FRESH)


def end_session(token: contextvars.Token) -> None:
    _LAST_CALL.reset(token)


def record_call(sink: list, record: dict) -> None:
    """Append ``record`` (one LLM call) to the session's ``sink`` with its ``parent``: the last call on this branch.
    This branch's last call is then the new one."""
    record["parent"] = _LAST_CALL.get()
    sink.append(record)
    _LAST_CALL.set(len(sink) - 1)


@contextlib.contextmanager
def fresh_context() -> Iterator[None]:
    """Calls inside the block start a fresh context (a sub-agent); the branch continues where it was afterwards."""
    token = _LAST_CALL.set(FRESH)
    try:
        yield
    finally:
        _LAST_CALL.reset(token)


def condense() -> None:
    """The next call on this branch starts a fresh context (the loop condensed or reset its context)."""
    _LAST_CALL.set(FRESH)


def truncate_calls(calls: list[dict[str, Any]], max_context: int) -> list[dict[str, Any]]:
    """The calls clipped to the row budget (``len(prompt) + rollout.response_length``), as verl truncates the
    concatenated row: a response is cut where prompt + response reaches ``max_context``; a call whose prompt alone
    reaches it is dropped with every call below it (its descendants: on a chain every later call), so no step row is
    longer than a verl row. The kept calls' ``parent`` (where they name one; default the previous call) is
    renumbered. The input is not changed."""
    out: list[dict[str, Any]] = []
    new_index: dict[int, int] = {}
    for k, call in enumerate(calls):
        parent = int(call.get("parent", k - 1))
        room = max_context - len(call["prompt_ids"])
        if room <= 0 or (parent != FRESH and parent not in new_index):
            continue  # over the budget, or below a dropped call
        call = dict(call)
        if "parent" in call:
            call["parent"] = new_index[parent] if parent != FRESH else FRESH
        if len(call["response_ids"]) > room:
            call["response_ids"] = call["response_ids"][:room]
            if call.get("response_logprobs") is not None:
                call["response_logprobs"] = call["response_logprobs"][:room]
        new_index[k] = len(out)
        out.append(call)
    return out


def leaves(calls: Sequence[dict[str, Any]]) -> list[bool]:
    """Which calls no other call continues (``parent``, default the previous call): the session's leaves."""
    below = [False] * len(calls)
    for k, call in enumerate(calls):
        parent = int(call.get("parent", k - 1))
        if parent != FRESH:
            below[parent] = True
    return [not b for b in below]


def with_leaf_outcomes(calls: list[dict[str, Any]], outcomes: Optional[Sequence[Any]]) -> list[dict[str, Any]]:
    """``calls`` with each leaf's own outcome (``outcomes``: one entry per call, a number at every leaf and ``None``
    elsewhere; ``None`` for all: the session's outcome on every leaf, recorded as nothing). Raises naming
    ``leaf_rewards`` for a count, a leaf without a number or a non-leaf with one."""
    if outcomes is None:
        return calls
    is_leaf = leaves(calls)
    if len(outcomes) != len(calls):
        raise StepExpansionError(f"leaf_rewards returned {len(outcomes)} entries for {len(calls)} LLM calls. Fix: "
                                 "return one entry per recorded call: a number at each leaf, None elsewhere.",
                                 field="leaf_rewards", every_rollout=True)
    bad = next((k for k, (o, leaf) in enumerate(zip(outcomes, is_leaf)) if (o is None) == leaf), None)
    if bad is not None:
        what = "a leaf without an outcome" if is_leaf[bad] else "a call that other calls continue, given an outcome"
        raise StepExpansionError(f"leaf_rewards()[{bad}] = {outcomes[bad]!r}: call {bad} is {what}. Fix: give a "
                                 "number to every call no other call continues (leaves()), None to the others.",
                                 field="leaf_rewards", every_rollout=True)
    return [dict(c, outcome=float(o)) if o is not None else c for c, o in zip(calls, outcomes)]
