"""The pure core (torch + numpy only; never imports verl, ray or transformers), in folders by who runs them:

* :mod:`verl_traj.core.plan` -- the driver's planning: layout, mini-batches, ranks, micro-batches, padding, loss
  weights (and the prefix-tree plans);
* :mod:`verl_traj.core.packing` -- the planner's packing and DP balancing;
* :mod:`verl_traj.core.trees` -- prefix trees as data, built on the driver and again on the device;
* :mod:`verl_traj.core.kernels` -- the GPU workers' tree attention, kernel and tree pass;
* :mod:`verl_traj.core.rollout` -- the rollout ledger: session ledgers, row keys and tags (agent-loop workers),
  staleness, the lag cap and the weights' health, failures, length bias (driver);
* the root: :mod:`~verl_traj.core.errors`, :mod:`~verl_traj.core.keys` (the per-row field names) and
  :mod:`~verl_traj.core.sorting`, which every folder may import. The folders import one way: packing, trees and rollout
  only the root, kernels trees, plan packing and trees (tests/test_code_shape.py).

Pipeline: :func:`build_layout` (validate ids, steps, count tokens) -> :func:`plan_mini_batches`
(whole units per mini-batch, DP balancing, rank-major layout, padding, micro-batch packing, global
statistics) -> :func:`apply_plan` (materialise it on a batch's columns and attach the per-row facts
named in :mod:`verl_traj.core.keys`) -> :func:`compute_loss_weights` (per update, from those facts).

Inputs are checked where they enter; every refusal is a :class:`TrajInputError` (``.field`` names the input),
see :mod:`verl_traj.core.errors`.
"""

from . import keys
from .errors import (TrajInputError, check_binary_mask, check_choice, check_finite, check_index, check_int,
                     check_options, check_positive_number, check_shape)
from .packing.balancing import WORKLOAD_MODELS, balance_equal_size, calculate_workload, round_robin_equal_size
from .plan.layout import BatchLayout, BatchLayoutError, build_layout, build_layout_from_counts, check_ids, factorize
from .plan.loss_weights import RowStats, compute_loss_weights, loss_weight_modes, register_loss_weight
from .packing.packing import MICRO_BATCH_COSTS, MicroBatchPacking, PackingError, min_micro_batches, pack_micro_batches
from .plan.padding import apply_plan, pad_attention_mask, pad_position_ids, resolve_pad_token_id
from .plan.planning import (
    GROUP_BY_CHOICES,
    MINI_BATCH_BALANCE_CHOICES,
    PAD_ROW_TOKENS,
    PAD_UID_PREFIX,
    MiniBatchPlan,
    MiniBatchStats,
    PlanError,
    PlanSpec,
    assign_units,
    count_splits,
    mini_batch_order,
    plan_mini_batches,
)

__all__ = [
    "keys",
    "TrajInputError",
    "check_binary_mask",
    "check_choice",
    "check_finite",
    "check_ids",
    "check_index",
    "check_int",
    "check_options",
    "check_positive_number",
    "check_shape",
    "resolve_pad_token_id",
    "BatchLayout",
    "BatchLayoutError",
    "build_layout",
    "build_layout_from_counts",
    "factorize",
    "PlanSpec",
    "MiniBatchPlan",
    "MiniBatchStats",
    "PlanError",
    "PackingError",
    "plan_mini_batches",
    "assign_units",
    "count_splits",
    "mini_batch_order",
    "apply_plan",
    "pad_attention_mask",
    "pad_position_ids",
    "calculate_workload",
    "balance_equal_size",
    "round_robin_equal_size",
    "pack_micro_batches",
    "min_micro_batches",
    "MicroBatchPacking",
    "MICRO_BATCH_COSTS",
    "WORKLOAD_MODELS",
    "GROUP_BY_CHOICES",
    "MINI_BATCH_BALANCE_CHOICES",
    "PAD_UID_PREFIX",
    "PAD_ROW_TOKENS",
    "RowStats",
    "compute_loss_weights",
    "loss_weight_modes",
    "register_loss_weight",
]
