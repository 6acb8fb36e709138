"""A user's own verl agent loop, trained on step rows by verl_traj: a digit-guessing game.

``GuessDigitLoop`` is an ordinary verl ``AgentLoopBase``: it talks to the LLM server itself, turn after turn, and
appends the environment's answer to the context between calls (tokens the model did not generate: response mask 0).
Nothing in it knows about verl_traj. ``StepwiseGuessDigitLoop`` is the one line that makes it train on step rows
(one row per LLM call, merged back where a call's context continues the previous one), plus a turn reward per call.

Run it (docs/agent_loops.md):

    PYTHONPATH=examples/own_agent_loop python -m verl_traj.main_ppo --config-name cpu_tiny \\
        actor_rollout_ref.rollout.agent.agent_loop_config_path=examples/own_agent_loop/agent_loops.yaml \\
        actor_rollout_ref.rollout.agent.default_agent_loop=guess_digit traj.step_wise=true \\
        data.max_response_length=64 reward.custom_reward_function.path=examples/own_agent_loop/reward.py
"""

from __future__ import annotations

import re
from typing import Any, Optional
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput

from verl_traj.agent_loops import StepRecordingMixin

MAX_GUESSES = 3
TOKENS_PER_GUESS = 8  # each call is a short guess; the trajectory's whole budget is rollout.response_length
CORRECT = "=> correct"  # what the environment says on a right guess; reward.py scores the trajectory by it
FORMAT_REWARD = 0.1  # turn reward of a call that made a guess at all


def first_digit(text: str) -> Optional[int]:
    match = re.search(r"\d", text)
    return int(match.group()) if match else None


class GuessDigitLoop(AgentLoopBase):
    """Guess the task's digit (the dataset's ``reward_model.ground_truth``) in up to :data:`MAX_GUESSES` calls; after
    each wrong guess the environment says "higher" or "lower"."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        target = int(kwargs["reward_model"]["ground_truth"])
        text = self.tokenizer.apply_chat_template(list(kwargs["raw_prompt"]), add_generation_prompt=True,
                                                  tokenize=False)
        prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)
        ids, mask, logprobs = list(prompt_ids), [], []
        budget = self.rollout_config.response_length
        request_id = uuid4().hex
        per_call = {**sampling_params, "max_tokens": TOKENS_PER_GUESS}
        for turn in range(MAX_GUESSES):
            out = await self.server_manager.generate(request_id=request_id, prompt_ids=ids, sampling_params=per_call)
            ids += out.token_ids
            mask += [1] * len(out.token_ids)
            logprobs += list(out.log_probs or [0.0] * len(out.token_ids))
            guess = first_digit(self.tokenizer.decode(out.token_ids))
            answer = CORRECT if guess == target else ("higher" if guess is None or guess < target else "lower")
            observation = self.tokenizer.encode(f"\n{answer}\n", add_special_tokens=False)
            ids += observation  # the environment's tokens: in the context, never trained
            mask += [0] * len(observation)
            logprobs += [0.0] * len(observation)
            if answer == CORRECT or len(mask) >= budget:
                break
        # verl's v1 trainer reads the policy versions of the tokens from extra_fields (min/max_global_steps): verl's
        # loops copy the server output's extra_fields; verl_traj fills them from what it recorded if a loop does not
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=ids[len(prompt_ids):][:budget],
                               response_mask=mask[:budget], response_logprobs=logprobs[:budget],
                               num_turns=2 * (turn + 1), metrics={})


class StepwiseGuessDigitLoop(StepRecordingMixin, GuessDigitLoop):
    """The same loop, every LLM call recorded for step rows; a turn reward for each call that made a guess."""

    def step_rewards(self, calls: list[dict[str, Any]], output: Any) -> list[float]:
        return [FORMAT_REWARD if first_digit(self.tokenizer.decode(c["response_ids"])) is not None else 0.0
                for c in calls]
