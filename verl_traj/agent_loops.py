"""What you import to train your own verl agent loop on step rows (docs/agent_loops.md), under a name that does not
move when the adapters' layout does: :class:`StepRecordingMixin` (put it in front of your loop), the recording
tool-agent loop the shipped ``configs/agent_loops/stepwise.yaml`` registers (:class:`StepwiseToolAgentLoop`), and
the branching API (docs/branching.md): forks are asyncio tasks, :func:`fresh_context` runs a sub-agent in its own
context, :func:`condense` resets the context, :func:`leaves` names the calls ``leaf_rewards`` scores."""

from verl_traj.integration.agent_loops.call_branches import condense, fresh_context, leaves
from verl_traj.integration.agent_loops.stepwise_agent_loop import StepRecordingMixin, StepwiseToolAgentLoop

__all__ = ["StepRecordingMixin", "StepwiseToolAgentLoop", "condense", "fresh_context", "leaves"]
