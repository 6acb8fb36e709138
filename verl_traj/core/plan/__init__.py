"""The driver's planning: a batch's layout, its mini-batches, ranks and micro-batches, their padding and loss weights.

Runs on: the driver (the trainer's ``_balance_batch``; loss weights per update on the workers' planned rows).
May import: packing, trees (the prefix-tree plans price micro-batches in tree tokens).

Pure: torch and numpy. :func:`~verl_traj.core.plan.layout.build_layout` -> :func:`~verl_traj.core.plan.planning.
plan_mini_batches` -> :func:`~verl_traj.core.plan.padding.apply_plan` -> :func:`~verl_traj.core.plan.loss_weights.
compute_loss_weights`; :mod:`verl_traj.core.packing` packs and balances for it, ``tree_planning`` is its
prefix-tree mode, ``estimators`` the names it knows.
"""
