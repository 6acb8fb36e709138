"""The calculator agent's loops. With turn rewards: verl's tool agent loop, recording every LLM call (step rows), that
also gives each call a small reward of its own when it makes a calculator call that evaluates (a well-formed expression
the tool can compute), on top of the trajectory's outcome reward (``task.compute_score``).

Switched on by pointing verl's ``tool_agent`` name at it (``configs/agent_loops/calc_turn_rewards.yaml``), with
``traj.step_wise=true``, on either trainer:

    python -m verl_traj.main_ppo --config-name calc_agent_cpu traj.step_wise=true \\
      'actor_rollout_ref.rollout.agent.agent_loop_config_path=${verl_traj_pkg:}/configs/agent_loops/calc_turn_rewards.yaml'
"""

from __future__ import annotations

from typing import Any, Optional

from verl_traj.integration.agent_loops.stepwise_agent_loop import RecordingServerManager, StepwiseToolAgentLoop
from verl_traj.recipes.calc_agent.task import CALL_RE, CalculatorError, evaluate

__all__ = ["TURN_REWARD", "CalcTurnRewardAgentLoop", "CalcWindowedAgentLoop", "WindowedContext", "turn_rewards"]

TURN_REWARD = 0.05  # per call that computes something: small beside the outcome's 1.0


def turn_rewards(responses: list[str], bonus: float = TURN_REWARD) -> list[float]:
    """``bonus`` for each response that holds a calculator call whose expression evaluates, else 0.0."""
    out = []
    for text in responses:
        ok = False
        for expression in CALL_RE.findall(text or ""):
            try:
                evaluate(expression)
                ok = True
            except CalculatorError:
                pass
        out.append(bonus if ok else 0.0)
    return out


class CalcTurnRewardAgentLoop(StepwiseToolAgentLoop):
    """verl's tool agent loop + step recording + :func:`turn_rewards` on each call."""

    def step_rewards(self, calls: list[dict[str, Any]], output: Any) -> Optional[list[float]]:
        texts = [self.tokenizer.decode(call["response_ids"], skip_special_tokens=True) for call in calls]
        return turn_rewards(texts)


class WindowedContext(RecordingServerManager):
    """Sends each LLM call a rewritten context, as agents that trim their history do: the first call's prompt (system
    prompt, tools, task) and only the last :attr:`keep` turns (a turn: the model's response and the tool result after
    it); records what it sends. From call ``keep + 2`` on, a call's context is no longer the previous call's context
    plus its response: the merge chain breaks, and the rows share only the first prompt and part of the window."""

    keep = 1

    def __init__(self, inner: Any, sink: list[dict[str, Any]]):
        super().__init__(inner, sink)
        self._first: Optional[list[int]] = None
        self._turns: list[list[list[int]]] = []  # [response ids, tool-result ids] per call so far
        self._seen = 0  # the agent's own context length after the last response

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        if "prompt_ids" not in kwargs:
            raise TypeError("WindowedContext rewrites prompt_ids passed by keyword (verl's tool agent loop does)")
        full = list(kwargs["prompt_ids"])
        if self._first is None:
            self._first = full
        else:
            self._turns[-1][1] = full[self._seen:]  # what the agent appended after the last response
        window = [t for response, result in self._turns[len(self._turns) - self.keep:] for t in response + result]
        out = await super().generate(*args, **{**kwargs, "prompt_ids": self._first + window})
        self._turns.append([list(out.token_ids), []])
        self._seen = len(full) + len(out.token_ids)
        return out


class CalcWindowedAgentLoop(StepwiseToolAgentLoop):
    """The calculator agent with a context window (:class:`WindowedContext`): step rows whose merge chains break, the
    workload prefix trees are for (``configs/agent_loops/calc_window.yaml``)."""

    recorder_cls = WindowedContext
