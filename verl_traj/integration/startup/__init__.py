"""Start-up on the driver, before Ray starts: every check and every settled default behind one entry,
:func:`~verl_traj.integration.startup.checks.check_startup` (:mod:`.checks`); ``traj:`` against verl's sections
(:mod:`.verl_checks`); ``traj.prefix_tree`` settled (:mod:`.tree_checks`); what the CPU platform settles
(:mod:`.cpu_settings`: attention, LoRA on the CPU rollout, ``separate_async``'s pool and weight sync).

May import: config, rows, tree, async_modes, engines.
"""
