"""The agent-loop processes: the step-wise agent loop that records every LLM call (:mod:`.stepwise_agent_loop`), v1's
agent-loop worker and manager that store each session as its step rows (:mod:`.v1_agent_loop`), and tool calls no
tool can run (:mod:`.tool_call_checks`).

May import: config, rows, patches, async_modes.
"""
