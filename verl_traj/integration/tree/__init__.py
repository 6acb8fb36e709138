"""The prefix tree's engine path, run in the actor, reference and critic worker processes: the plan's tree facts as
per-row fields (:mod:`.tree_plan_facts`, built on the driver), one micro-batch forwarded as a tree through verl's FSDP
engine (:mod:`.tree_forward`), each pass's trees (:mod:`.tree_passes`), what they record (:mod:`.tree_log`), and the
flash-attention path in torch for a CUDA process without flash-attn (:mod:`.torch_flash`).

May import: patches.
"""
