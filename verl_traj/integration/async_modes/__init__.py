"""v1's asynchronous modes and what they let go: staleness per trajectory (:mod:`.v1_staleness`), failed groups
(:mod:`.v1_failures`), both in the replay buffer (driver) and around each session (agent-loop processes), the lengths
of the trajectories the buffer lets go, by cause (:mod:`.cut_lengths`, for ``traj_bias/*``), and ``separate_async``'s
batch rule (:mod:`.separate_async`, start-up).

May import: config.
"""
