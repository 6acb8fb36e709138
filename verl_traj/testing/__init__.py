"""Synthetic batches and real step-length data for verl_traj's tests and benchmarks (like ``torch.testing``).

Not imported by the training path. See :mod:`verl_traj.testing.batches` for the one batch factory and
:mod:`verl_traj.testing.swebench` for the SWE-bench step lengths.
"""

from .batches import (
    RandomBatch,
    as_dataproto,
    random_batch,
    rl_batch,
    step_record_batch,
    swebench_batch,
    token_trajectory,
    verl_tensors,
)

__all__ = [
    "RandomBatch",
    "as_dataproto",
    "random_batch",
    "rl_batch",
    "step_record_batch",
    "swebench_batch",
    "token_trajectory",
    "verl_tensors",
]
