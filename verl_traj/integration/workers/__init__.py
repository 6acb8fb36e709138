"""The worker processes: verl's engine workers told which mini-batches and micro-batches to run
(:mod:`.engine_workers`; the role each class serves: :func:`~.engine_workers.traj_role_worker`), the planned update
they check and run, with what its losses record (:mod:`.planned_update`), the losses (:mod:`.losses`) and GSPO's
trajectory-wide sequence ratio (:mod:`.actor_sequence_ratios`).

May import: patches, tree.
"""
