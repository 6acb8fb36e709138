"""The worker processes: verl's engine workers told which mini-batches and micro-batches to run
(:mod:`.engine_workers`; the role each class serves: :func:`~.engine_workers.traj_role_worker`), the planned update
they check and run, with what its losses record (:mod:`.planned_update`), and the losses (:mod:`.losses`). GSPO's
trajectory-wide sequence ratio is a step of the actor's update (its pre-pass:
:class:`~.engine_workers.TrajActorTrainingWorker`, the arithmetic in :mod:`verl_traj.stepwise.ratios`).

May import: patches, tree, engines.
"""
