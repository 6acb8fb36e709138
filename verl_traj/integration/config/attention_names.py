"""The attention implementations verl_traj registers with transformers, by name: what start-up chooses and checks
(:mod:`verl_traj.integration.startup`) and what the CPU platform plugin registers under them (:mod:`verl_traj.cpu`:
``cpu_varlen`` in :mod:`verl_traj.cpu.attention`, ``torch_varlen`` in :mod:`verl_traj.cpu.torch_flash`). One
definition, below both, so start-up never imports the plugin's code."""

__all__ = ["CPU_VARLEN", "TORCH_VARLEN"]

CPU_VARLEN = "cpu_varlen"  # flash-attention's code path in torch, the CPU platform's attention for padding-free rows
TORCH_VARLEN = "torch_varlen"  # the same path on a CUDA process without flash-attn
