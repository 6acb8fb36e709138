"""v1's asynchronous modes: staleness per trajectory (:mod:`.v1_staleness`), failed groups (:mod:`.v1_failures`), both
in the replay buffer (driver) and around each session (agent-loop processes), and ``separate_async``'s batch rule
(:mod:`.separate_async`, start-up).

May import: config.
"""
