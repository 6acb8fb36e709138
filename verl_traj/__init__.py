"""verl_traj: trajectory-aware multi-turn RL training on top of verl 0.9.x.

Layout (the split is deliberate):
- ``verl_traj.core``: pure planning (torch/numpy only; no Ray, no GPU, no verl worker imports):
  batch layout, mini-batch plans, DP balancing, padding rows, micro-batch packing, loss weights.
- ``verl_traj.stepwise``: pure step-wise helpers: advantage broadcast and prefix merging.
- ``verl_traj.integration``: thin verl adapters (trainer, workers, losses, agent loops).
- ``verl_traj.cpu``: CPU platform plugin and CPU rollout backend so verl trains without a GPU.
- ``verl_traj.config``: the validated ``traj:`` section.
"""

__version__ = "0.1.0"
