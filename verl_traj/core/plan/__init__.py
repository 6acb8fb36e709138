"""The driver's planning: a batch's layout, its mini-batches, ranks and micro-batches, their padding and loss weights.

Runs on: the driver (the trainer's ``_balance_batch``; loss weights per update on the workers' planned rows).
May import: trees (the prefix-tree plans price micro-batches in tree tokens).

Pure: torch and numpy. :func:`~verl_traj.core.plan.layout.build_layout` -> :func:`~verl_traj.core.plan.planning.
plan_mini_batches` -> :func:`~verl_traj.core.plan.padding.apply_plan` -> :func:`~verl_traj.core.plan.loss_weights.
compute_loss_weights`; packing (``packing``, ``bin_packing``, ``batch_packing``, ``padded_packing``) and balancing
serve the planner, ``tree_planning`` its prefix-tree mode, ``estimators`` the names it knows.
"""
