"""Mini-batch plan: whole trajectories / groups per mini-batch, DP-balanced, rank-major, padded.

:func:`plan_mini_batches` turns a :class:`~verl_traj.core.layout.BatchLayout` into a
:class:`MiniBatchPlan`:

1. **Units.** A unit is a trajectory (``group_by="trajectory"``) or every trajectory of one prompt
   group (``group_by="group"``, the default: GRPO statistics and the whole group land in the same
   optimizer step). Units are never split.
2. **Mini-batches.** Exactly ``num_mini_batches`` (the user's ``train_batch_size /
   ppo_mini_batch_size``, whatever the number of turns). Units go to mini-batches by LPT on tokens
   (largest unit first to the lightest mini-batch; heap; seed-permuted tie-breaks). A unit larger
   than a fair share (``total_tokens / num_mini_batches``) is allowed -- its mini-batch is just
   bigger -- and counted in ``units_larger_than_mini_batch``. Fewer units than mini-batches raises
   :class:`PlanError`: an empty mini-batch would still be an optimizer step (or silently change the
   number of steps and the LR schedule), so we refuse rather than guess.
3. **Padding.** Mini-batch ``m`` with ``n_m`` real rows gets ``(-n_m) % dp_size`` padding rows (the
   fewest that make it divisible by ``dp_size``); each holds 2 attended tokens and no loss token.
4. **DP balancing** (:mod:`verl_traj.core.balancing`): rows (padding included, as near-zero cost
   items) are spread over ranks with equal counts, minimising the slowest rank's workload.
   Padding rows therefore land where they lower the slowest rank: on ranks whose real rows are
   already heavy, i.e. every rank ends with the least possible workload.
5. **Rank-major output.** Rank ``r`` holds the contiguous block ``[r*B_out/dp, (r+1)*B_out/dp)``:
   its rows of mini-batch 0 (real rows in source order, then padding), then of mini-batch 1, ...
6. **Micro-batches** (optional, :mod:`verl_traj.core.packing`) under ``micro_batch_max_tokens``.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Literal, Optional

import numpy as np
import torch

from .balancing import WORKLOAD_MODELS, balance_equal_size, calculate_workload, round_robin_equal_size
from .layout import BatchLayout
from .packing import pack_micro_batches

__all__ = [
    "PAD_UID_PREFIX",
    "PAD_ROW_TOKENS",
    "PlanError",
    "MiniBatchStats",
    "MiniBatchPlan",
    "plan_mini_batches",
    "mini_batch_order",
]

PAD_UID_PREFIX = "__verl_traj_pad__"
PAD_ROW_TOKENS = 2  # attended tokens of a padding row: last prompt position + first response position


class PlanError(ValueError):
    """The batch cannot be planned as configured (message names the numbers and the fix)."""


@dataclass(frozen=True)
class MiniBatchStats:
    """Global per-mini-batch statistics; every ``[M]`` tensor excludes padding unless named ``padding_*``.

    These are the numbers losses divide by (global over DP ranks and micro-batches).
    """

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
    micro_batches_lower_bound: torch.Tensor  # [M] int64 max over ranks of ceil(rank tokens / cap)
    max_packed_tokens: torch.Tensor  # [M] int64 largest real-token sum of one micro-batch
    real_micro_batches: torch.Tensor  # [M] int64 micro-batches holding >= 1 real row, summed over ranks
    ranks_short_of_rows: torch.Tensor  # [M] int64 ranks with fewer rows than the synced count


@dataclass(frozen=True)
class MiniBatchPlan:
    """Where every row goes. Output position ``i`` (of ``B_out``) takes source row ``order[i]``
    (``-1`` = a new padding row). Invariants: every real source row appears exactly once; no unit
    spans two mini-batches; ``B_out = dp_size * rows_per_rank.sum()``; rank ``r``'s block is
    ``[r*B_out/dp, (r+1)*B_out/dp)`` and holds ``rows_per_rank[m]`` rows of mini-batch ``m`` in
    mini-batch order."""

    order: torch.Tensor  # [B_out] int64
    mini_batch_id: torch.Tensor  # [B_out] int64
    is_padding: torch.Tensor  # [B_out] bool
    dp_size: int
    num_mini_batches: int
    rows_per_rank: torch.Tensor  # [M] int64
    stats: MiniBatchStats
    num_source_rows: int
    group_by: str
    workload: str
    seed: int
    units_larger_than_mini_batch: int
    micro_batch_max_tokens: Optional[int] = None
    micro_batch_index: Optional[torch.Tensor] = None  # [B_out] int64 micro-batch within (rank, mini-batch)
    split_trajectories: int = 0
    split_groups: int = 0
    extra: dict = field(default_factory=dict)  # {"timing_s": {"units_s", "balance_s", "stats_s", "packing_s"}}

    @property
    def num_rows(self) -> int:
        return int(self.order.shape[0])

    @property
    def rank(self) -> torch.Tensor:
        """``[B_out]`` int64 DP rank of each output position."""
        per_rank = self.num_rows // self.dp_size
        return torch.arange(self.num_rows, dtype=torch.long) // per_rank

    def metrics(self, prefix: str = "traj_plan") -> dict[str, float]:
        """Flat floats for the logger (padding excluded from every token / row count but ``padding_*``)."""
        s = self.stats
        lb = s.workload_lower_bound.double().clamp(min=1)
        ratio = s.max_rank_workload.double() / lb
        p = prefix.rstrip("/") + "/"
        out = {
            "num_mini_batches": float(self.num_mini_batches),
            "dp_size": float(self.dp_size),
            "real_rows": float(s.real_rows.sum()),
            "trajectories": float(s.trajectories.sum()),
            "groups": float(s.groups.sum()),
            "loss_tokens": float(s.loss_tokens.sum()),
            "tokens": float(s.tokens.sum()),
            "split_trajectories": float(self.split_trajectories),
            "split_groups": float(self.split_groups),
            "balance_ratio_mean": float(ratio.mean()),
            "balance_ratio_worst": float(ratio.max()),
            "padding_rows": float(s.padding_rows.sum()),
            "padding_tokens": float(s.padding_tokens.sum()),
            "units_larger_than_mini_batch": float(self.units_larger_than_mini_batch),
            "rows_per_mini_batch_min": float(s.real_rows.min()),
            "rows_per_mini_batch_max": float(s.real_rows.max()),
            "loss_tokens_per_mini_batch_min": float(s.loss_tokens.min()),
            "loss_tokens_per_mini_batch_max": float(s.loss_tokens.max()),
        }
        if self.micro_batch_max_tokens is not None:
            n_micro = float(s.micro_batches.sum())
            out.update(
                {
                    "micro_batches": n_micro,  # per rank, summed over mini-batches
                    "micro_batches_lower_bound": float(s.micro_batches_lower_bound.sum()),
                    "micro_batches_over_lower_bound": n_micro / max(float(s.micro_batches_lower_bound.sum()), 1.0),
                    "tokens_per_micro_batch": float(s.tokens.sum()) / max(n_micro * self.dp_size, 1.0),
                    "max_packed_tokens": float(s.max_packed_tokens.max()),
                    "micro_batches_with_real_rows": float(s.real_micro_batches.sum()),  # over all ranks
                    "real_tokens_per_micro_batch": float(s.tokens.sum()) / max(float(s.real_micro_batches.sum()), 1.0),
                    "ranks_short_of_rows": float(s.ranks_short_of_rows.sum()),
                }
            )
        return {p + k: v for k, v in out.items()}


def mini_batch_order(num_mini_batches: int, epoch: int, seed: int, shuffle: bool) -> torch.Tensor:
    """Order in which the mini-batches of one training batch are stepped in epoch ``epoch``.

    Returns ``[num_mini_batches]`` int64: a permutation, identical on every rank (it depends only on
    its arguments); ``arange`` when ``shuffle`` is False.
    """
    if not shuffle:
        return torch.arange(num_mini_batches, dtype=torch.long)
    g = torch.Generator()
    g.manual_seed((int(seed) * 1_000_003 + int(epoch) * 7919 + 12345) % (2**63 - 1))
    return torch.randperm(num_mini_batches, generator=g)


def _assign_units_lpt(unit_tokens: np.ndarray, num_bins: int, rng: np.random.Generator) -> np.ndarray:
    """LPT: units by tokens descending (seed-permuted ties) to the lightest bin. ``[U] -> [U]`` bin."""
    u = unit_tokens.shape[0]
    perm = rng.permutation(u)
    order = perm[np.argsort(-unit_tokens[perm], kind="stable")]
    assign = np.empty(u, dtype=np.int64)
    # first num_bins units: one per bin (bin order seed-permuted), then heap
    first = order[:num_bins]
    bins0 = rng.permutation(num_bins)
    assign[first] = bins0
    heap = [(int(unit_tokens[i]), int(b)) for i, b in zip(first.tolist(), bins0.tolist())]
    heapq.heapify(heap)
    rest = order[num_bins:]
    out = np.empty(rest.shape[0], dtype=np.int64)
    push = heapq.heapreplace
    for k, t in enumerate(unit_tokens[rest].tolist()):
        load, b = heap[0]
        push(heap, (load + t, b))
        out[k] = b
    assign[rest] = out
    return assign


def _count_pairs(a: np.ndarray, b: np.ndarray, nb: int) -> int:
    """Number of distinct (a, b) pairs."""
    return int(np.unique(a.astype(np.int64) * nb + b).shape[0])


def plan_mini_batches(
    layout: BatchLayout,
    num_mini_batches: int,
    dp_size: int,
    *,
    group_by: Literal["group", "trajectory"] = "group",
    balance_dp: bool = True,
    workload: Literal["verl", "tokens"] = "verl",
    micro_batch_max_tokens: Optional[int] = None,
    seed: int = 0,
) -> MiniBatchPlan:
    """Plan one training batch. See the module docstring for the algorithm.

    Args:
        layout: from :func:`~verl_traj.core.layout.build_layout`; input padding rows are dropped.
        num_mini_batches: optimizer steps for this batch (``train_batch_size // ppo_mini_batch_size``).
        dp_size: data-parallel ranks.
        group_by: unit kept whole inside one mini-batch.
        balance_dp: False = rows dealt round-robin over ranks (no workload balancing).
        workload: cost model for DP balancing (``"verl"``: ``24576*L + L^2``; ``"tokens"``: ``L``).
        micro_batch_max_tokens: optional per-rank per-micro-batch token cap; plans the packing.
        seed: tie-breaks; the same inputs and seed give the same plan.
    Raises:
        PlanError: bad config, or fewer units than mini-batches.
        PackingError: cap below the longest row.
    """
    if group_by not in ("group", "trajectory"):
        raise PlanError(f"group_by={group_by!r}; choose 'group' (whole GRPO groups) or 'trajectory'.")
    if workload not in WORKLOAD_MODELS:
        raise PlanError(f"workload={workload!r}; choose one of {WORKLOAD_MODELS}.")
    if int(num_mini_batches) < 1 or int(dp_size) < 1:
        raise PlanError(f"num_mini_batches={num_mini_batches} and dp_size={dp_size} must both be >= 1.")
    if micro_batch_max_tokens is not None and int(micro_batch_max_tokens) < 1:
        raise PlanError(f"micro_batch_max_tokens={micro_batch_max_tokens} must be >= 1 (or None for no cap).")
    M, dp = int(num_mini_batches), int(dp_size)
    rng = np.random.default_rng(seed)
    clock = [time.perf_counter()]
    timing: dict[str, float] = {}

    def lap(name: str) -> None:
        now = time.perf_counter()
        timing[name] = now - clock[0]
        clock[0] = now

    real_rows = np.flatnonzero(~layout.is_padding.numpy())
    tokens_all = layout.num_tokens.numpy()
    tokens = tokens_all[real_rows]
    loss_tokens = layout.num_loss_tokens.numpy()[real_rows]
    traj = layout.traj_index.numpy()[real_rows]
    grp = layout.group_index.numpy()[real_rows]
    T, G = layout.num_trajectories, layout.num_groups

    # 1-2. units -> mini-batches
    unit = grp if group_by == "group" else traj
    U = G if group_by == "group" else T
    if U < M:
        what = "groups (distinct uids)" if group_by == "group" else "trajectories"
        raise PlanError(
            f"train batch has {U} {what} but {M} mini-batches were configured "
            f"(train_batch_size / ppo_mini_batch_size); each mini-batch is one optimizer step and needs at least "
            f"one whole {'group' if group_by == 'group' else 'trajectory'}, and an empty mini-batch would change "
            "the number of optimizer steps. Fix: lower the number of mini-batches (raise ppo_mini_batch_size), "
            "raise train_batch_size" + (", or use group_by='trajectory'" if group_by == "group" else "") + "."
        )
    unit_tokens = np.bincount(unit, weights=tokens, minlength=U).astype(np.int64)
    unit_mb = _assign_units_lpt(unit_tokens, M, rng)
    fair_share = tokens.sum() / M
    units_larger = int((unit_tokens > fair_share).sum())
    mb = unit_mb[unit]
    lap("units_s")

    # 3. padding items
    n_real = np.bincount(mb, minlength=M).astype(np.int64)
    n_pad = (-n_real) % dp
    P = int(n_pad.sum())
    item_mb = np.concatenate([mb, np.repeat(np.arange(M, dtype=np.int64), n_pad)])
    item_src = np.concatenate([real_rows.astype(np.int64), np.full(P, -1, dtype=np.int64)])
    item_tokens = np.concatenate([tokens, np.full(P, PAD_ROW_TOKENS, dtype=np.int64)])
    item_loss = np.concatenate([loss_tokens, np.zeros(P, dtype=np.int64)])
    item_cost = calculate_workload(item_tokens, workload)
    item_pad = item_src < 0

    # 4. DP balancing
    if balance_dp:
        tiebreak = rng.permutation(item_mb.shape[0])
        item_rank = balance_equal_size(item_cost, item_mb, M, dp, tiebreak=tiebreak)
    else:
        item_rank = round_robin_equal_size(item_mb, M, dp)
    lap("balance_s")

    # 5. rank-major order: (rank, mini-batch, padding last, source row)
    src_key = np.where(item_pad, np.arange(item_src.shape[0]), item_src)
    out = np.lexsort((src_key, item_pad, item_mb, item_rank))
    rows_per_rank = (n_real + n_pad) // dp

    # 6. statistics
    block = item_mb * dp + item_rank
    # exact int sums (a float64 bincount can lose precision above 2**53)
    rank_workload = _exact_block_sum(item_cost, block, M * dp).reshape(M, dp)
    real_block = block[~item_pad]
    rank_tokens = _exact_block_sum(tokens, real_block, M * dp).reshape(M, dp)
    rank_loss = _exact_block_sum(loss_tokens, real_block, M * dp).reshape(M, dp)
    total_w = rank_workload.sum(1)
    max_item = np.zeros(M, dtype=np.int64)
    np.maximum.at(max_item, item_mb, item_cost)
    lower = np.maximum(-(-total_w // dp), max_item)
    traj_mb_pairs = np.unique(traj * M + mb)
    traj_per_mb = np.bincount(traj_mb_pairs % M, minlength=M)
    grp_mb_pairs = np.unique(grp * M + mb)
    grp_per_mb = np.bincount(grp_mb_pairs % M, minlength=M)
    split_traj = int(traj_mb_pairs.shape[0] - T)
    split_grp = int(grp_mb_pairs.shape[0] - G)
    lap("stats_s")

    # 7. micro-batches
    micro_index = None
    micro = np.zeros(M, dtype=np.int64)
    micro_lb = np.zeros(M, dtype=np.int64)
    max_packed = np.zeros(M, dtype=np.int64)
    real_micro = np.zeros(M, dtype=np.int64)
    short = np.zeros(M, dtype=np.int64)
    if micro_batch_max_tokens is not None:
        cap = int(micro_batch_max_tokens)
        packing = pack_micro_batches(item_tokens, block, np.arange(M * dp) // dp, M * dp, cap)
        micro = packing.block_count.reshape(M, dp).max(1)
        short = packing.ranks_short_of_rows.reshape(M, dp).sum(1).astype(np.int64)
        micro_lb = (-(-rank_tokens // cap)).max(1)
        mkey = block * (int(packing.micro_index.max()) + 1) + packing.micro_index
        real_key = mkey[~item_pad]
        uniq, inv = np.unique(real_key, return_inverse=True)
        sums = np.bincount(inv.reshape(-1), weights=tokens).astype(np.int64)
        uniq_mb = (uniq // (int(packing.micro_index.max()) + 1)) // dp
        np.maximum.at(max_packed, uniq_mb, sums)
        real_micro = np.bincount(uniq_mb, minlength=M).astype(np.int64)
        micro_index = torch.from_numpy(packing.micro_index[out])
    lap("packing_s")

    stats = MiniBatchStats(
        real_rows=torch.from_numpy(n_real),
        trajectories=torch.from_numpy(traj_per_mb.astype(np.int64)),
        groups=torch.from_numpy(grp_per_mb.astype(np.int64)),
        loss_tokens=torch.from_numpy(rank_loss.sum(1)),
        tokens=torch.from_numpy(rank_tokens.sum(1)),
        padding_rows=torch.from_numpy(n_pad.astype(np.int64)),
        padding_tokens=torch.from_numpy(n_pad.astype(np.int64) * PAD_ROW_TOKENS),
        max_rank_workload=torch.from_numpy(rank_workload.max(1)),
        workload_lower_bound=torch.from_numpy(lower),
        rank_workload=torch.from_numpy(rank_workload),
        rank_tokens=torch.from_numpy(rank_tokens),
        rank_loss_tokens=torch.from_numpy(rank_loss),
        micro_batches=torch.from_numpy(micro),
        micro_batches_lower_bound=torch.from_numpy(micro_lb),
        max_packed_tokens=torch.from_numpy(max_packed),
        real_micro_batches=torch.from_numpy(real_micro),
        ranks_short_of_rows=torch.from_numpy(short),
    )
    return MiniBatchPlan(
        order=torch.from_numpy(item_src[out]),
        mini_batch_id=torch.from_numpy(item_mb[out]),
        is_padding=torch.from_numpy(item_pad[out]),
        dp_size=dp,
        num_mini_batches=M,
        rows_per_rank=torch.from_numpy(rows_per_rank),
        stats=stats,
        num_source_rows=layout.num_rows,
        group_by=group_by,
        workload=workload,
        seed=int(seed),
        units_larger_than_mini_batch=units_larger,
        micro_batch_max_tokens=None if micro_batch_max_tokens is None else int(micro_batch_max_tokens),
        micro_batch_index=micro_index,
        split_trajectories=split_traj,
        split_groups=split_grp,
        extra={"timing_s": timing},
    )


def _exact_block_sum(values: np.ndarray, block: np.ndarray, num_blocks: int) -> np.ndarray:
    """``[num_blocks]`` int64 exact sums of ``values`` per block (``np.add.at``, no float rounding)."""
    out = np.zeros(num_blocks, dtype=np.int64)
    np.add.at(out, block, values.astype(np.int64, copy=False))
    return out
