"""The worker side of prefix trees: tree attention (blocked, and compiled ``flex_attention`` on CUDA), the kernel at
the model's edge, and a worker's tree pass.

Runs on: the GPU workers (actor, critic, reference), inside verl's engine forward.
May import: trees.

Pure: torch (no verl); the engine hooks that call them live in :mod:`verl_traj.integration.tree`.
"""
