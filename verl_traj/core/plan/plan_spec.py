"""What a mini-batch plan is asked for and what it is: :class:`PlanSpec` (checked once, :func:`checked_spec`),
:class:`MiniBatchPlan` with its :class:`MiniBatchStats`, :class:`PlanError`, and the planner's named choices.
:func:`~verl_traj.core.plan.planning.plan_mini_batches` turns a layout and a spec into a plan."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Literal, Optional

import numpy as np
import torch

from verl_traj.core.errors import TrajInputError, check_choice, check_int
from verl_traj.core.packing.balancing import WORKLOAD_MODELS
from verl_traj.core.packing.packing import MICRO_BATCH_COSTS
from verl_traj.core.plan.plan_metrics import plan_metrics
from verl_traj.core.trees.tree_cost import TreeCostModel

__all__ = ["GROUP_BY_CHOICES", "MINI_BATCH_BALANCE_CHOICES", "PAD_ROW_TOKENS", "PAD_UID_PREFIX", "MiniBatchPlan",
           "MiniBatchStats", "PlanError", "PlanSpec", "checked_spec"]

PAD_UID_PREFIX = "__verl_traj_pad__"
PAD_ROW_TOKENS = 2  # default attended tokens of a padding row: last prompt position + first response position
GROUP_BY_CHOICES = ("group", "trajectory")
MINI_BATCH_BALANCE_CHOICES = ("tokens", "units")


class PlanError(TrajInputError):
    """The batch cannot be planned as configured (message names the numbers and the fix)."""


@dataclass(frozen=True)
class PlanSpec:
    """What to plan. ``micro_batch_max_tokens=None`` plans no micro-batches (one per rank and mini-batch
    is then left to the engine); ``micro_batch_cost`` is the attention path's cost model and
    ``micro_batch_pass_cost`` the fixed cost of a pass in padded positions (:mod:`verl_traj.core.packing.packing`);
    ``pad_row_tokens`` the attended tokens of a padding row."""

    num_mini_batches: int
    dp_size: int
    group_by: Literal["group", "trajectory"] = "group"
    mini_batch_balance: Literal["tokens", "units"] = "tokens"
    balance_dp: bool = True
    workload: Literal["verl", "tokens"] = "verl"
    micro_batch_max_tokens: Optional[int] = None
    micro_batch_cost: Literal["tokens", "padded", "padded_area"] = "tokens"
    micro_batch_pass_cost: Optional[int] = None
    pad_row_tokens: int = PAD_ROW_TOKENS
    seed: int = 0
    prefix_tree: bool = False  # place units as prefix trees (:mod:`verl_traj.core.plan.tree_planning`); needs ``rows``
    # with prefix_tree: the device's cost model; a piece whose tree does not pay is cut into its rows, placed as the
    # rows path places them (None: every piece a tree; :func:`~verl_traj.core.plan.tree_planning.tree_pieces`)
    tree_cost: Optional[TreeCostModel] = None

    def __post_init__(self) -> None:
        """Every field checked (a :class:`PlanError` naming it) and normalised (numpy ints -> int)."""
        for name, value in checked_spec(self).items():
            object.__setattr__(self, name, value)


def checked_spec(spec: PlanSpec) -> dict:
    """The spec's fields, checked: ints >= their minimum, choices among theirs, a bool, costs finite."""
    def whole(name: str, minimum: int, what: str) -> int:
        return check_int(name, getattr(spec, name), f"set {name} to an int >= {minimum} ({what})", minimum=minimum,
                         error=PlanError)

    out = {"num_mini_batches": whole("num_mini_batches", 1, "train_batch_size / ppo_mini_batch_size"),
           "dp_size": whole("dp_size", 1, "the data-parallel size"),
           "pad_row_tokens": whole("pad_row_tokens", 2, "one prompt and one response position"),
           "seed": whole("seed", 0, "the plan's random seed")}
    for name, choices in (("group_by", GROUP_BY_CHOICES), ("mini_batch_balance", MINI_BATCH_BALANCE_CHOICES),
                          ("workload", WORKLOAD_MODELS), ("micro_batch_cost", MICRO_BATCH_COSTS)):
        check_choice(name, getattr(spec, name), choices, error=PlanError)
    for name in ("balance_dp", "prefix_tree"):
        if not isinstance(getattr(spec, name), (bool, np.bool_)):
            raise PlanError.invalid(name, getattr(spec, name), "is not a bool", f"pass {name}=True or False")
        out[name] = bool(getattr(spec, name))
    if spec.tree_cost is not None and not isinstance(spec.tree_cost, TreeCostModel):
        raise PlanError.invalid("tree_cost", spec.tree_cost, "is not a TreeCostModel",
                                "pass verl_traj.core.trees.tree_cost.tree_cost_model(device), or None")
    if spec.micro_batch_max_tokens is not None:
        out["micro_batch_max_tokens"] = whole("micro_batch_max_tokens", 1, "tokens per micro-batch, or None for no cap")
    pass_cost = spec.micro_batch_pass_cost
    if pass_cost is not None and (isinstance(pass_cost, (bool, np.bool_)) or not isinstance(pass_cost, numbers.Real)
                                  or not 0 <= float(pass_cost) < float("inf")):
        raise PlanError.invalid("micro_batch_pass_cost", pass_cost, "must be a finite number >= 0",
                                "give the padded positions per forward/backward pass, or None for the token cost's "
                                "micro-batch count")
    return out


@dataclass(frozen=True)
class MiniBatchStats:
    """Global per-mini-batch statistics; every ``[M]`` tensor excludes padding unless named ``padding_*``."""

    real_rows: torch.Tensor  # [M] int64
    trajectories: torch.Tensor  # [M] int64 trajectories (whole, never split)
    groups: torch.Tensor  # [M] int64 distinct uids
    loss_tokens: torch.Tensor  # [M] int64 sum of response_mask
    tokens: torch.Tensor  # [M] int64 sum of attention_mask
    padding_rows: torch.Tensor  # [M] int64
    padding_tokens: torch.Tensor  # [M] int64 attended tokens of padding rows
    max_rank_workload: torch.Tensor  # [M] int64 slowest rank (padding rows included, they do run)
    workload_lower_bound: torch.Tensor  # [M] int64 max(ceil(total / dp), max row workload)
    rank_workload: torch.Tensor  # [M, dp] int64
    rank_tokens: torch.Tensor  # [M, dp] int64 real tokens per rank
    rank_loss_tokens: torch.Tensor  # [M, dp] int64
    # micro-batch packing (zeros when no cap was given)
    micro_batches: torch.Tensor  # [M] int64 micro-batches per rank (synced over ranks)
    micro_batches_lower_bound: torch.Tensor  # [M] int64 max over ranks of the fewest micro-batches possible (packing)
    max_packed_tokens: torch.Tensor  # [M] int64 largest attended-token sum of one micro-batch
    padded_positions: torch.Tensor  # [M] int64 positions computed without remove-padding minus attended tokens
    ranks_short_of_rows: torch.Tensor  # [M] int64 ranks with fewer rows than the synced count
    # prefix-tree plans only (None otherwise)
    tree_tokens: Optional[torch.Tensor] = None  # [M] int64 tree tokens of the pieces (what the forwards hold)
    atomic_trajectories: Optional[torch.Tensor] = None  # [M] int64 trajectories whose rows share one micro-batch


@dataclass(frozen=True)
class MiniBatchPlan:
    """Where every row goes. Output position ``i`` (of ``B_out``) takes source row ``order[i]``
    (``-1`` = a new padding row). Invariants: every real source row appears exactly once; no unit
    spans two mini-batches; ``B_out = dp_size * rows_per_rank.sum()``; rank ``r``'s block is
    ``[r*B_out/dp, (r+1)*B_out/dp)`` and holds ``rows_per_rank[m]`` rows of mini-batch ``m`` in
    mini-batch order; ``traj_index`` is the layout's dense trajectory index carried to the output."""

    order: torch.Tensor  # [B_out] int64
    mini_batch_id: torch.Tensor  # [B_out] int64, 0..M-1
    micro_batch_id: torch.Tensor  # [B_out] int64 micro-batch within (rank, mini-batch); 0 without a cap
    traj_index: torch.Tensor  # [B_out] int64, dense 0..T-1, -1 on padding rows
    is_padding: torch.Tensor  # [B_out] bool
    rows_per_rank: torch.Tensor  # [M] int64
    stats: MiniBatchStats
    spec: PlanSpec
    num_source_rows: int
    units_larger_than_mini_batch: int
    split_trajectories: int = 0
    split_groups: int = 0
    timing_s: dict = field(default_factory=dict)  # {"units_s", "balance_s", "stats_s", "packing_s"}

    @property
    def dp_size(self) -> int:
        return int(self.spec.dp_size)

    @property
    def num_mini_batches(self) -> int:
        return int(self.spec.num_mini_batches)

    @property
    def num_rows(self) -> int:
        return int(self.order.shape[0])

    @property
    def all_trajectories_atomic(self) -> bool:
        """A prefix-tree plan that put every trajectory's rows in one micro-batch on one rank (GSPO's trajectory
        ratio can then come from the loss); False for a row plan."""
        s = self.stats
        return s.atomic_trajectories is not None and int(s.atomic_trajectories.sum()) == int(s.trajectories.sum())

    @property
    def rank(self) -> torch.Tensor:
        """``[B_out]`` int64 DP rank of each output position."""
        return torch.arange(self.num_rows, dtype=torch.long) // (self.num_rows // self.dp_size)

    def metrics(self, prefix: str = "traj_plan") -> dict[str, float]:
        """Flat floats for the logger (padding excluded from every token / row count but ``padding_*``)."""
        return plan_metrics(self, prefix)
