"""An agent whose session branches, trained by verl_traj as one call tree: the digit-guessing game of
``examples/own_agent_loop`` with best-of-N from a mid-state and a checker sub-agent.

One session: the first guess; the environment's answer ("higher" / "lower" / correct); then :data:`BRANCHES` branches
from that state, each guessing once more on its own (asyncio tasks: each continues from the first call, whatever order
they finish in); then a checker sub-agent in a fresh context of its own, asked to repeat the digit it is shown. Each
leaf has its own outcome (:meth:`StepwiseBestOfNLoop.leaf_rewards`): a branch 1.0 when it guessed right, the checker
1.0 when it repeated the digit, either :data:`FORMAT_REWARD` for a wrong digit and 0 for none. The session's transcript
for verl's reward function is its first branch's.

verl_traj records each call's parent (the first call for the branches, none for the checker), trains the session as
one row per branch plus one for the checker (the branches' rows share the first call's context, forwarded once under
prefix trees), and credits each call with the mean of its leaves' advantages (docs/branching.md).

    PYTHONPATH=examples/branching_agent python -m verl_traj.main_ppo --config-name cpu_tiny \\
        actor_rollout_ref.rollout.agent.agent_loop_config_path=examples/branching_agent/agent_loops.yaml \\
        actor_rollout_ref.rollout.agent.default_agent_loop=best_of_n traj.step_wise=true \\
        data.max_response_length=64 reward.custom_reward_function.path=examples/branching_agent/reward.py
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, Optional
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput

from verl_traj.agent_loops import StepRecordingMixin, fresh_context, leaves

BRANCHES = 2
TOKENS_PER_GUESS = 8
CORRECT = "=> correct"
FORMAT_REWARD = 0.1  # a leaf that gave a digit, not the right one


def first_digit(text: str) -> Optional[int]:
    match = re.search(r"\d", text)
    return int(match.group()) if match else None


class BestOfNLoop(AgentLoopBase):
    """Guess the task's digit (``reward_model.ground_truth``): one guess, the environment's answer, then
    :data:`BRANCHES` second guesses from that state, then a checker sub-agent in its own context."""

    async def _call(self, ids: list[int], sampling_params: dict[str, Any]) -> Any:
        return await self.server_manager.generate(request_id=uuid4().hex, prompt_ids=ids,
                                                  sampling_params={**sampling_params, "max_tokens": TOKENS_PER_GUESS})

    def _answer(self, token_ids: list[int], target: int) -> list[int]:
        guess = first_digit(self.tokenizer.decode(token_ids))
        answer = CORRECT if guess == target else ("higher" if guess is None or guess < target else "lower")
        return self.tokenizer.encode(f"\n{answer}\n", add_special_tokens=False)

    async def _branch(self, ids: list[int], sampling_params: dict[str, Any], target: int) -> tuple[Any, list[int]]:
        out = await self._call(ids, sampling_params)
        return out, self._answer(out.token_ids, target)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        target = int(kwargs["reward_model"]["ground_truth"])
        self.target = target
        text = self.tokenizer.apply_chat_template(list(kwargs["raw_prompt"]), add_generation_prompt=True,
                                                  tokenize=False)
        prompt = self.tokenizer.encode(text, add_special_tokens=False)
        first = await self._call(prompt, sampling_params)
        observation = self._answer(first.token_ids, target)
        state = prompt + list(first.token_ids) + observation  # the mid-state every branch continues from
        branches = await asyncio.gather(*(self._branch(state, sampling_params, target) for _ in range(BRANCHES)))
        with fresh_context():  # a checker sub-agent: its own context, not a continuation of the session's
            check = self.tokenizer.encode(f"Repeat this digit: {target}\n", add_special_tokens=False)
            await self._call(check, sampling_params)
        out, answer = branches[0]  # the session's transcript: its first branch
        response = list(first.token_ids) + observation + list(out.token_ids) + answer
        mask = [1] * len(first.token_ids) + [0] * len(observation) + [1] * len(out.token_ids) + [0] * len(answer)
        logprobs = list(first.log_probs or [0.0] * len(first.token_ids)) + [0.0] * len(observation) + \
            list(out.log_probs or [0.0] * len(out.token_ids)) + [0.0] * len(answer)
        budget = self.rollout_config.response_length
        return AgentLoopOutput(prompt_ids=prompt, response_ids=response[:budget], response_mask=mask[:budget],
                               response_logprobs=logprobs[:budget], num_turns=4, metrics={})


class StepwiseBestOfNLoop(StepRecordingMixin, BestOfNLoop):
    """The same loop, every LLM call recorded with its parent; each leaf scored on its own."""

    def leaf_rewards(self, calls: list[dict[str, Any]], output: Any) -> list[Optional[float]]:
        """A number for each leaf (each branch's guess, the checker's answer), ``None`` for the first call."""
        out: list[Optional[float]] = []
        for call, leaf in zip(calls, leaves(calls)):
            digit = first_digit(self.tokenizer.decode(call["response_ids"]))
            out.append(None if not leaf else 1.0 if digit == self.target else 0.0 if digit is None else FORMAT_REWARD)
        return out
