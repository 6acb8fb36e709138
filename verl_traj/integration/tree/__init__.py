"""The prefix tree's engine path, run in the actor, reference and critic worker processes: a worker's passes on
trees, each micro-batch forwarded as a tree through verl's FSDP engine (:mod:`.tree_forward`; what a pass checks and
records, and the attention's side, are the pure :mod:`verl_traj.core.kernels.tree_pass` and :mod:`verl_traj.core.kernels.tree_kernel`).
The trees' facts are built on the driver (:mod:`verl_traj.integration.trainers.tree_plan_facts`) and shipped with the
plan; the flash-attention path in torch that serves the tree on a CUDA machine without flash-attn is installed by the
plugin in every process (:mod:`verl_traj.cpu.torch_flash`).

May import: patches, engines.
"""
