"""The worker processes: verl's engine workers told which mini-batches and micro-batches to run
(:mod:`.engine_workers`; the role each class serves: :func:`~.engine_workers.traj_role_worker`), the planned-update
contract they check (:mod:`.planned_update`), the losses (:mod:`.losses`, with :mod:`.loss_sink` for what they
record) and GSPO's trajectory-wide sequence ratio (:mod:`.actor_sequence_ratios`).

May import: patches, tree.
"""
