"""Recipes: complete training set-ups shipped with the package (data preparation, task, reward, tools),
launched with ``python -m verl_traj.main_ppo --config-name <preset>``; the launchers live in ``examples/``."""
