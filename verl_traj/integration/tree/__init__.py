"""The prefix tree's engine path, run in the actor, reference and critic worker processes: a worker's passes on
trees, each micro-batch forwarded as a tree through verl's FSDP engine (:mod:`.tree_forward`; what a pass checks and
records, and the attention's side, are the pure :mod:`verl_traj.core.tree_pass` and :mod:`verl_traj.core.tree_kernel`),
and the flash-attention path in torch for a CUDA process without flash-attn
(:mod:`.torch_flash`). The trees' facts are built on the driver
(:mod:`verl_traj.integration.trainers.tree_plan_facts`) and shipped with the plan.

May import: patches.
"""
