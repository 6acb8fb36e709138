"""verl's config, read once and the same way everywhere (driver: start-up and the trainers' ``__init__``).

* :mod:`.access`: typed readers of verl's settings (``value_at``, ``uses_critic``, ``ulysses_size``, ...);
* :mod:`.verl_config`: the verl settings the plan depends on, set on a checked config (:class:`PlanSettings`);
* :mod:`.update_spec`: every fact of an update both trainers need, derived once (:class:`UpdateSpec`);
* :mod:`.attention_names`: the attention implementations verl_traj registers, by name (start-up chooses among them,
  the CPU plugin registers them).

May import: engines (the strategies whose micro-batches are planned).
"""
