"""The calculator agent with turn rewards: verl's tool agent loop, recording every LLM call (step rows), that also
gives each call a small reward of its own when it makes a calculator call that evaluates (a well-formed expression
the tool can compute), on top of the trajectory's outcome reward (``task.compute_score``).

Switched on by pointing verl's ``tool_agent`` name at it (``configs/agent_loops/calc_turn_rewards.yaml``), with
``traj.step_wise=true``, on either trainer:

    python -m verl_traj.main_ppo --config-name calc_agent_cpu traj.step_wise=true \\
      'actor_rollout_ref.rollout.agent.agent_loop_config_path=${verl_traj_pkg:}/configs/agent_loops/calc_turn_rewards.yaml'
"""

from __future__ import annotations

from typing import Any, Optional

from verl_traj.integration.stepwise_agent_loop import StepwiseToolAgentLoop
from verl_traj.recipes.calc_agent.task import CALL_RE, CalculatorError, evaluate

__all__ = ["TURN_REWARD", "CalcTurnRewardAgentLoop", "turn_rewards"]

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
