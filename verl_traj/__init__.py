"""verl_traj: trajectory-aware multi-turn RL training on top of verl 0.9.x.

Layout (the split is deliberate):
- ``verl_traj.core``: pure planning (torch/numpy only; no Ray, no GPU, no verl worker imports):
  batch layout, mini-batch plans, DP balancing, padding rows, micro-batch packing, loss weights.
- ``verl_traj.stepwise``: pure step-wise helpers: advantage broadcast and prefix merging.
- ``verl_traj.integration``: thin verl adapters (trainer, workers, losses, agent loops).
- ``verl_traj.cpu``: CPU platform plugin and CPU rollout backend so verl trains without a GPU.
- ``verl_traj.config``: the validated ``traj:`` section.
"""

from pathlib import Path

try:
    from omegaconf import OmegaConf
except ImportError:  # pragma: no cover - omegaconf comes with verl
    OmegaConf = None

__version__ = "0.1.0"


def _register_config_resolvers() -> None:
    """Absolute paths in configs (Ray workers do not run in the launch directory): ``${verl_traj_pkg:}`` =
    the installed ``verl_traj`` package directory, ``${verl_traj_repo:}`` = the directory holding it (the
    checkout). Registered on any ``import verl_traj...``, so they exist in the driver and the task runner."""
    if OmegaConf is None:
        return
    pkg = Path(__file__).resolve().parent
    for name, path in (("verl_traj_pkg", str(pkg)), ("verl_traj_repo", str(pkg.parent))):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, lambda path=path: path)


_register_config_resolvers()
