"""Agent loops for the end-to-end tests, loaded by Ray's agent-loop workers from an agent-loop yaml
(``_target_: verl_traj.testing.agent_loops.<Class>``), so they live in the package."""

from __future__ import annotations

import asyncio
import zlib
from typing import Any, Optional

from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

from verl_traj.integration.agent_loops.stepwise_agent_loop import StepwiseToolAgentLoop

__all__ = ["TURN_REWARD", "FailingAgentLoop", "InjectedToolCrash", "SlowAgentLoop", "TurnRewardToolAgentLoop",
           "injected_failure", "slow_session"]

TURN_REWARD = 0.125  # every LLM call's own reward (exact in binary: the sums the tests compare are exact)


class TurnRewardToolAgentLoop(StepwiseToolAgentLoop):
    """verl's tool agent loop with step recording and a turn reward of :data:`TURN_REWARD` on every LLM call, so a
    run shows turn rewards travelling through ``python -m verl_traj.main_ppo`` (their sum and count per step are
    logged as ``traj_stepwise/turn_reward_sum`` / ``turn_rewards_nonzero`` on both trainers)."""

    def step_rewards(self, calls: list[dict[str, Any]], output: Any) -> Optional[list[float]]:
        return [TURN_REWARD] * len(calls)


class InjectedToolCrash(RuntimeError):
    """The failure :class:`FailingAgentLoop` raises (its class name is the logged reason)."""


def injected_failure(uid: str, session_id: int) -> bool:
    """Which sessions :class:`FailingAgentLoop` fails, the same in every run (prompt uids are seeded): session 1 of
    every group whose uid hashes even, and every session of a group whose uid hashes to 0 mod 5 (no survivor)."""
    code = zlib.crc32(str(uid).encode())
    return code % 5 == 0 or (int(session_id) == 1 and code % 2 == 0)


class FailingAgentLoop(SingleTurnAgentLoop):
    """verl's single-turn loop whose :func:`injected_failure` sessions fail like a crashing tool (``fail: raise``:
    :class:`InjectedToolCrash`) or a hanging one (``fail: hang``: sleeps until ``traj.trajectory_timeout_s`` ends it).
    Selected with an agent-loop yaml: ``- name: single_turn_agent`` / ``_target_: ...FailingAgentLoop`` / ``fail:
    raise``."""

    def __init__(self, *args: Any, fail: str = "raise", **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.fail = fail

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        if injected_failure(kwargs["uid"], kwargs.get("session_id", 0)):
            if self.fail == "hang":
                await asyncio.sleep(3600)
            raise InjectedToolCrash(f"injected tool crash in session {kwargs.get('session_id')} of {kwargs['uid']}")
        return await super().run(sampling_params, **kwargs)


def slow_session(uid: str, session_id: int, every: int = 3) -> bool:
    """Which sessions :class:`SlowAgentLoop` holds, the same in every run: session 0 of every group whose uid hashes
    to 0 mod ``every`` (about one group in ``every`` finishes late)."""
    return int(session_id) == 0 and zlib.crc32(str(uid).encode()) % every == 0


class SlowAgentLoop(SingleTurnAgentLoop):
    """verl's single-turn loop whose :func:`slow_session` sessions hold their finished answer ``delay_s`` seconds
    before returning it, like a slow tool or a slow environment: their tokens stay of the policy that sampled them
    while training moves on, so their group's oldest token falls several versions behind (the lag cap of
    ``traj.stale_groups=correct`` acts on them, not on a mocked buffer). Selected with an agent-loop yaml: ``- name:
    single_turn_agent`` / ``_target_: ...SlowAgentLoop`` / ``delay_s: 20`` / ``every: 3``."""

    def __init__(self, *args: Any, delay_s: float = 20.0, every: int = 3, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.delay_s, self.every = float(delay_s), int(every)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        output = await super().run(sampling_params, **kwargs)
        if slow_session(kwargs["uid"], kwargs.get("session_id", 0), self.every):
            await asyncio.sleep(self.delay_s)
        return output
