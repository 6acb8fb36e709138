"""The rollout ledger: what each trajectory's generation recorded and what the replay buffer decides from it.

Runs on: the agent-loop workers (the session ledger, row keys and tags they write) and the driver (staleness, the lag
cap and the weights' health, failures, length bias, read by the replay buffer's policies and the trainer's metrics).
May import: trees (the prefix block hashes a written row is tagged with, for the tree planner).

Pure: torch, numpy and the standard library.
"""
