"""verl_traj's hydra configs (shipped with the package; ``configs/`` at the top of the checkout links here).

``traj_ppo.yaml`` (verl's ``ppo_trainer`` + the ``traj:`` section), presets (``cpu_tiny``, ``cpu_tiny_ppo``,
``quickstart``, ``calc_agent_{cpu,cpu_ppo,gpu}``), and groups: ``traj/``, ``platform/``, ``task/``,
``agent_loops/``. ``python -m verl_traj.main_ppo --config-name <preset>`` finds them wherever the package is.
"""

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent
