"""Start-up on the driver, before Ray starts: every check and every settled default behind one entry,
:func:`~verl_traj.integration.startup.checks.check_startup` (:mod:`.checks`); ``traj:`` against verl's sections
(:mod:`.verl_checks`); ``traj.prefix_tree`` settled (:mod:`.tree_checks`).

May import: config, rows, tree, async_modes.
"""
