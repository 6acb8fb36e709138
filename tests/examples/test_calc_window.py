"""The calculator recipe's context-window loop (:class:`~verl_traj.recipes.calc_agent.agent_loop.WindowedContext`):
what each LLM call is sent and recorded, against an agent whose own context grows append-only (verl's tool loop)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from verl_traj.recipes.calc_agent.agent_loop import WindowedContext


class _Server:
    def __init__(self):
        self.sent = []

    async def generate(self, *, request_id, prompt_ids, sampling_params):
        self.sent.append(list(prompt_ids))
        step = len(self.sent)
        return SimpleNamespace(token_ids=[100 * step, 100 * step + 1], log_probs=[-0.5, -0.5])


def _agent(turns: int):
    """The agent's own context after each call: task [1, 2, 3], then response + tool result [9, step] per call."""
    server, calls = _Server(), []
    window = WindowedContext(server, calls)
    context = [1, 2, 3]

    async def run():
        nonlocal context
        for _ in range(turns):
            out = await window.generate(request_id="r", prompt_ids=context, sampling_params={})
            context = context + list(out.token_ids) + [9, len(server.sent)]

    asyncio.run(run())
    return server.sent, calls


def test_each_call_sees_the_task_and_the_last_turn_and_the_record_is_what_was_sent():
    sent, calls = _agent(4)
    assert sent == [[1, 2, 3], [1, 2, 3, 100, 101, 9, 1], [1, 2, 3, 200, 201, 9, 2], [1, 2, 3, 300, 301, 9, 3]]
    assert [c["prompt_ids"] for c in calls] == sent
    assert [c["response_ids"] for c in calls] == [[100, 101], [200, 201], [300, 301], [400, 401]]
    # calls 1 -> 2 continue the chain; from call 3 on a call's context does not extend the previous call's
    chain = [b["prompt_ids"][:len(a["prompt_ids"]) + 2] == a["prompt_ids"] + a["response_ids"]
             for a, b in zip(calls, calls[1:])]
    assert chain == [True, False, False]


def test_positional_prompts_are_refused():
    window = WindowedContext(_Server(), [])
    with pytest.raises(TypeError, match="prompt_ids"):
        asyncio.run(window.generate("r", [1, 2], {}))
