"""Packing and balancing for the driver's planner: rows into the fewest micro-batches under a token cap (first-fit
bins, exact searches, padded-area runs), units onto DP ranks (longest-processing-time first).

Runs on: the driver (the planner, :mod:`verl_traj.core.plan`).
May import: nothing in the core but its root (errors, keys, sorting).

Pure: torch and numpy.
"""
