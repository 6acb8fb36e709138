"""The logger's view of a :class:`~verl_traj.core.plan.planning.MiniBatchPlan`: flat floats under ``traj_plan/``."""

from __future__ import annotations

from typing import Any

__all__ = ["plan_metrics"]


def plan_metrics(plan: Any, prefix: str = "traj_plan") -> dict[str, float]:
    """Padding is excluded from every token / row count but ``padding_*``. ``balance_ratio_*`` is the
    slowest rank's workload over its lower bound (1.0 = perfect); micro-batch keys appear with a cap."""
    s = plan.stats
    ratio = s.max_rank_workload.double() / s.workload_lower_bound.double().clamp(min=1)
    out = {
        "num_mini_batches": float(plan.num_mini_batches),
        "dp_size": float(plan.dp_size),
        "real_rows": float(s.real_rows.sum()),
        "trajectories": float(s.trajectories.sum()),
        "groups": float(s.groups.sum()),
        "loss_tokens": float(s.loss_tokens.sum()),
        "tokens": float(s.tokens.sum()),
        "split_trajectories": float(plan.split_trajectories),
        "split_groups": float(plan.split_groups),
        "balance_ratio_mean": float(ratio.mean()),
        "balance_ratio_worst": float(ratio.max()),
        "padding_rows": float(s.padding_rows.sum()),
        "padding_tokens": float(s.padding_tokens.sum()),
        "units_larger_than_mini_batch": float(plan.units_larger_than_mini_batch),
        "rows_per_mini_batch_min": float(s.real_rows.min()),
        "rows_per_mini_batch_max": float(s.real_rows.max()),
        "loss_tokens_per_mini_batch_min": float(s.loss_tokens.min()),
        "loss_tokens_per_mini_batch_max": float(s.loss_tokens.max()),
        "groups_per_mini_batch_min": float(s.groups.min()),
        "groups_per_mini_batch_max": float(s.groups.max()),
    }
    if plan.spec.micro_batch_max_tokens is not None:
        out.update(_micro_metrics(plan))
    if s.tree_tokens is not None:
        out.update(_tree_metrics(plan))
    p = prefix.rstrip("/") + "/"
    return {p + k: v for k, v in out.items()}


def _micro_metrics(plan: Any) -> dict[str, float]:
    s = plan.stats
    n_micro = float(s.micro_batches.sum())  # per rank, summed over mini-batches
    computed = float(s.tokens.sum() + s.padding_tokens.sum() + s.padded_positions.sum())
    return {
        "micro_batches": n_micro,
        "micro_batches_lower_bound": float(s.micro_batches_lower_bound.sum()),
        "micro_batches_over_lower_bound": n_micro / max(float(s.micro_batches_lower_bound.sum()), 1.0),
        "tokens_per_micro_batch": float(s.tokens.sum()) / max(n_micro * plan.dp_size, 1.0),
        "max_packed_tokens": float(s.max_packed_tokens.max()),
        "padded_positions_share": float(s.padded_positions.sum()) / max(computed, 1.0),
        "ranks_short_of_rows": float(s.ranks_short_of_rows.sum()),
    }


def _tree_metrics(plan: Any) -> dict[str, float]:
    """Prefix-tree plans: tree tokens planned (pieces' trees: an upper bound on what the forwards hold), row tokens
    over tree tokens, and the share of trajectories whose rows share one micro-batch on one rank."""
    s = plan.stats
    tree, rows = float(s.tree_tokens.sum()), float(s.tokens.sum())
    return {"tree_tokens": tree, "row_tokens_per_tree_token": rows / max(tree, 1.0),
            "atomic_trajectory_share": float(s.atomic_trajectories.sum()) / max(float(s.trajectories.sum()), 1.0)}
