"""What both trainer adapters (v0 ``RayPPOTrainer``, v1 ``PPOTrainer``) share around the core planner: the
one call that turns a layout into a plan with verl_traj's settings, the ``stock_plan/*`` observer metrics of
``traj.enable=false``, and the debug dump the end-to-end tests read.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import numpy as np
import torch

from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions

from verl_traj.config import TrajConfig, TrajConfigError
from verl_traj.core import (PAD_ROW_TOKENS, BatchLayout, MiniBatchPlan, build_layout_from_counts, count_splits,
                            plan_mini_batches)
from verl_traj.integration.config.verl_config import PlanSettings

__all__ = ["DEBUG_DUMP_ENV", "check_same_dp_size", "debug_dump", "plan_layout",
           "plan_step_metrics", "stock_plan_metrics", "stock_plan_metrics_of", "verl_partitioner"]

DEBUG_DUMP_ENV = "VERL_TRAJ_DEBUG_DUMP"  # a directory: one JSON line per step with the plan per row


def verl_partitioner(sizes: list[int], k: int) -> list[list[int]]:
    """verl's own micro-batch partition (Karmarkar-Karp on its workload model, ``equal_size=False``), offered
    to the planner as a candidate so a planned count never exceeds verl's ``rearrange_micro_batches`` (in blocks of
    at most ``PARTITIONER_LIMIT`` rows x micro-batches, :mod:`~verl_traj.core.packing.bin_packing`)."""
    workloads = calculate_workload(torch.tensor(sizes, dtype=torch.long)).tolist()
    return get_seqlen_balanced_partitions(workloads, k, equal_size=False)


def plan_layout(layout: BatchLayout, traj_config: TrajConfig, num_mini_batches: int, dp_size: int, *,
                micro: Optional[PlanSettings] = None, seed: Optional[int] = None,
                rows: Optional[list] = None) -> MiniBatchPlan:
    """The core plan of ``layout`` with the ``traj:`` settings and verl's micro-batch cap (``micro``; a cap
    derived from verl's settings is raised to the longest row, an explicit one is kept); ``rows``: every row's
    attended token ids (``traj.prefix_tree`` only: the plan then places prefix trees)."""
    cap = None
    if micro is not None and micro.engine_runs_plan:  # else the engine cuts its own: no micro-batches planned
        longest = int(layout.num_tokens.max())
        cap = max(micro.max_tokens, longest) if micro.derived else micro.max_tokens
    return plan_mini_batches(
        layout, num_mini_batches, dp_size, group_by=traj_config.group_by, mini_batch_balance=traj_config.mini_batch_balance,
        balance_dp=traj_config.balance_dp, workload=traj_config.workload, micro_batch_max_tokens=cap,
        micro_batch_cost=micro.cost if micro is not None else "tokens", micro_batch_pass_cost=traj_config.pass_cost_tokens,
        seed=traj_config.seed if seed is None else seed,
        pad_row_tokens=micro.pad_row_tokens if micro is not None else PAD_ROW_TOKENS,
        partitioner=verl_partitioner if micro is not None else None,
        prefix_tree=traj_config.trees, rows=rows,
        tree_cost=micro.tree_cost if micro is not None and traj_config.trees else None,
    )


def plan_step_metrics(plan: MiniBatchPlan, epochs: int) -> dict[str, float]:
    """The ``traj_plan/*`` metrics of one step, with the optimizer steps verl's config promises
    (mini-batches x ``actor.ppo_epochs``). ``actor/tree_share`` (the share of the step's micro-batches forwarded as
    prefix trees) comes with the tree facts, where the cost model decides it per micro-batch."""
    return {**plan.metrics("traj_plan"),
            "traj_plan/expected_optimizer_steps": float(plan.num_mini_batches * epochs)}


def check_same_dp_size(actor_dp: int, critic_dp: Optional[int]) -> int:
    """``actor_dp``; a :class:`TrajConfigError` when a critic (``critic_dp`` not None) has another DP size."""
    if critic_dp is not None and critic_dp != actor_dp:
        raise TrajConfigError(
            f"actor DP size {actor_dp} != critic DP size {critic_dp}: verl_traj plans one rank-major layout for "
            "both. Use the same data-parallel size for actor and critic."
        )
    return actor_dp


def stock_plan_metrics_of(config: Any, uid: Any, traj_id: Optional[Any], is_padding: Optional[Any],
                          dp_size: int) -> dict[str, float]:
    """:func:`stock_plan_metrics` with the mini-batch size and epochs read from verl's ``config``."""
    arr = config.actor_rollout_ref
    return stock_plan_metrics(uid, traj_id, is_padding, dp_size, int(arr.actor.ppo_mini_batch_size) * int(arr.rollout.n),
                              int(arr.actor.get("ppo_epochs", 1)))


def stock_plan_metrics(uid: Any, traj_id: Optional[Any], is_padding: Optional[Any], dp_size: int,
                       rows_per_mini_batch: int, epochs: int) -> dict[str, float]:
    """``stock_plan/*`` for ``traj.enable=false`` (nothing changes, this only observes): after verl's balancing
    each rank's contiguous shard is cut into consecutive mini-batches of ``rows_per_mini_batch / dp`` rows
    (``shuffle=false``, verl's default). ``uid`` / ``traj_id`` / ``is_padding``: ``[B]`` in dispatch order."""
    n = len(uid)
    per_rank, per_mb = n // dp_size, max(rows_per_mini_batch // dp_size, 1)
    mini_batch = (np.arange(n) % max(per_rank, 1)) // per_mb
    # lengths do not enter the split counts (no loss tokens: verl's padding rows carry none either)
    layout = build_layout_from_counts(np.ones(n, dtype=np.int64), np.zeros(n, dtype=np.int64), uid, traj_id=traj_id,
                                      step_index=None if traj_id is None else _step_numbers(traj_id),
                                      is_padding=is_padding)
    split_traj, split_grp = count_splits(layout.traj_index.numpy(), layout.group_index.numpy(), mini_batch)
    pads = float(np.asarray(is_padding, dtype=bool).sum()) if is_padding is not None else 0.0
    return {"stock_plan/split_groups": float(split_grp), "stock_plan/split_trajectories": float(split_traj),
            "stock_plan/num_mini_batches": float(mini_batch.max() + 1), "stock_plan/padding_rows": pads,
            "stock_plan/expected_optimizer_steps": float((mini_batch.max() + 1) * epochs)}


def _step_numbers(traj_id: Any) -> np.ndarray:
    """``0, 1, ...`` within each trajectory, in row order (the observer does not need verl's step order)."""
    codes = np.unique(np.asarray(traj_id, dtype=object).astype(str), return_inverse=True)[1]
    order = np.argsort(codes, kind="stable")
    counts = np.bincount(codes)
    steps = np.empty(len(codes), dtype=np.int64)
    steps[order] = np.arange(len(codes)) - np.repeat(np.cumsum(counts) - counts, counts)
    return steps


def debug_dump(step: int, plan: MiniBatchPlan, rows: dict[str, list]) -> None:
    """Append one JSON line (``step``, the plan's shape, ``rows``: per-row lists) to
    ``$VERL_TRAJ_DEBUG_DUMP/plan.jsonl``; nothing when the variable is unset."""
    out_dir = os.environ.get(DEBUG_DUMP_ENV)
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    rec = {"step": int(step), "dp_size": plan.dp_size, "num_mini_batches": plan.num_mini_batches,
           "mini_batch_id": plan.mini_batch_id.tolist(), "micro_batch_id": plan.micro_batch_id.tolist(),
           "is_padding": plan.is_padding.tolist(), **rows}
    with open(os.path.join(out_dir, "plan.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")
