"""Pure trajectory-aware batching core (torch + numpy only; never imports verl, ray or transformers).

Pipeline: :func:`build_layout` (validate ids, steps, count tokens) -> :func:`plan_mini_batches`
(whole units per mini-batch, DP balancing, rank-major layout, padding, micro-batch packing,
global statistics) -> :func:`apply_plan` (materialise on a batch's columns).
"""

from .balancing import WORKLOAD_MODELS, balance_equal_size, calculate_workload, round_robin_equal_size
from .layout import BatchLayout, BatchLayoutError, build_layout, build_layout_from_counts, factorize
from .packing import MicroBatchPacking, PackingError, pack_micro_batches
from .padding import apply_plan, pad_attention_mask, pad_position_ids
from .planning import (
    PAD_ROW_TOKENS,
    PAD_UID_PREFIX,
    MiniBatchPlan,
    MiniBatchStats,
    PlanError,
    mini_batch_order,
    plan_mini_batches,
)

try:  # written by another module owner; a missing file must not break the batching core
    from .loss_weights import compute_loss_weights
except ImportError:  # pragma: no cover
    compute_loss_weights = None  # type: ignore[assignment]

__all__ = [
    "BatchLayout",
    "BatchLayoutError",
    "build_layout",
    "build_layout_from_counts",
    "factorize",
    "MiniBatchPlan",
    "MiniBatchStats",
    "PlanError",
    "PackingError",
    "plan_mini_batches",
    "mini_batch_order",
    "apply_plan",
    "pad_attention_mask",
    "pad_position_ids",
    "calculate_workload",
    "balance_equal_size",
    "round_robin_equal_size",
    "pack_micro_batches",
    "MicroBatchPacking",
    "WORKLOAD_MODELS",
    "PAD_UID_PREFIX",
    "PAD_ROW_TOKENS",
    "compute_loss_weights",
]
