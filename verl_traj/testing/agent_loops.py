"""Agent loops for the end-to-end tests, loaded by Ray's agent-loop workers from an agent-loop yaml
(``_target_: verl_traj.testing.agent_loops.<Class>``), so they live in the package."""

from __future__ import annotations

from typing import Any, Optional

from verl_traj.integration.stepwise_agent_loop import StepwiseToolAgentLoop

__all__ = ["TURN_REWARD", "TurnRewardToolAgentLoop"]

TURN_REWARD = 0.125  # every LLM call's own reward (exact in binary: the sums the tests compare are exact)


class TurnRewardToolAgentLoop(StepwiseToolAgentLoop):
    """verl's tool agent loop with step recording and a turn reward of :data:`TURN_REWARD` on every LLM call, so a
    run shows turn rewards travelling through ``python -m verl_traj.main_ppo`` (their sum and count per step are
    logged as ``traj_stepwise/turn_reward_sum`` / ``turn_rewards_nonzero`` on both trainers)."""

    def step_rewards(self, calls: list[dict[str, Any]], output: Any) -> Optional[list[float]]:
        return [TURN_REWARD] * len(calls)
