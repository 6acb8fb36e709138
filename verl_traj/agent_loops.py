"""What you import to train your own verl agent loop on step rows (docs/agent_loops.md), under a name that does not
move when the adapters' layout does: :class:`StepRecordingMixin` (put it in front of your loop), and the recording
tool-agent loop the shipped ``configs/agent_loops/stepwise.yaml`` registers (:class:`StepwiseToolAgentLoop`)."""

from verl_traj.integration.agent_loops.stepwise_agent_loop import StepRecordingMixin, StepwiseToolAgentLoop

__all__ = ["StepRecordingMixin", "StepwiseToolAgentLoop"]
