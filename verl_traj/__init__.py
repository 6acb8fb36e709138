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


def _register_config_resolvers() -> None:
    """``${verl_traj_repo:}`` in configs = this checkout's root (absolute recipe paths; Ray workers
    do not run in the launch directory). Registered on any ``import verl_traj...``, so it exists in
    the driver and in the task-runner process alike."""
    try:
        from omegaconf import OmegaConf
    except ImportError:  # pragma: no cover - omegaconf comes with verl
        return
    if not OmegaConf.has_resolver("verl_traj_repo"):
        from pathlib import Path

        root = str(Path(__file__).resolve().parent.parent)
        OmegaConf.register_new_resolver("verl_traj_repo", lambda: root)


_register_config_resolvers()
