"""verl's batch-level functions on a planned batch (driver): advantages, the KL penalty, rewards and metrics on real
rows only (:mod:`.real_rows`), step rows' advantages and rollout correction per trajectory (:mod:`.stepwise_rows`),
per-call credit rules (GiGPO, any registered rule) in verl's estimator registry and their advantage (:mod:`.credit`). Both trainers reach them, v0 through
:func:`~verl_traj.integration.patches.scoped.fit_patches`, v1 through its planned advantage.

May import: nothing else in verl_traj.integration.
"""
