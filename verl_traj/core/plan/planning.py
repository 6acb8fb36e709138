"""Mini-batch plan: whole trajectories / groups per mini-batch, DP-balanced, rank-major, padded, packed.

:func:`plan_mini_batches` turns a :class:`~verl_traj.core.plan.layout.BatchLayout` into a
:class:`MiniBatchPlan` (what a plan is and is asked for: :mod:`verl_traj.core.plan.plan_spec`) in five stages, one
function each:

1. **Units -> mini-batches** (:func:`assign_units`). A unit is a trajectory (``group_by="trajectory"``)
   or every trajectory of one prompt group (``group_by="group"``, the default: GRPO statistics and the
   whole group land in the same optimizer step). Units are never split. Exactly ``num_mini_batches``
   mini-batches (the user's ``train_batch_size / ppo_mini_batch_size``, whatever the number of turns).
   ``mini_batch_balance="tokens"``: LPT on unit tokens (mini-batches of equal token mass, prompt counts
   may differ); ``"units"``: every mini-batch gets ``U // M`` or ``U // M + 1`` units (a fixed prompt
   count per optimizer step), LPT on tokens among those. Fewer units than mini-batches raises
   :class:`PlanError`: an empty mini-batch would change the number of optimizer steps.
2. **Padding** (:func:`padding_items`). Mini-batch ``m`` with ``n_m`` real rows gets ``(-n_m) % dp``
   padding rows, the fewest that give every rank the same number of rows.
3. **DP balancing** (:mod:`verl_traj.core.packing.balancing`): rows (padding included, near-zero cost) spread
   over ranks with equal counts per mini-batch, minimising the slowest rank's workload.
4. **Rank-major order**: rank ``r`` holds the contiguous block ``[r*B_out/dp, (r+1)*B_out/dp)``, its
   rows of mini-batch 0 (real rows in source order, then padding), then of mini-batch 1, ...
5. **Micro-batches** (:mod:`verl_traj.core.packing.packing`) under ``micro_batch_max_tokens``, with the cost of
   the attention path (``micro_batch_cost``), and the statistics of the plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from verl_traj.core.errors import check_options
from verl_traj.core.packing.balancing import balance_equal_size, calculate_workload, lpt, round_robin_equal_size
from verl_traj.core.packing.packing import Partitioner, pack_micro_batches
from verl_traj.core.plan.layout import BatchLayout
from verl_traj.core.plan.plan_spec import (GROUP_BY_CHOICES, MINI_BATCH_BALANCE_CHOICES, PAD_ROW_TOKENS, PAD_UID_PREFIX,
                                          MiniBatchPlan, MiniBatchStats, PlanError, PlanSpec)
from verl_traj.core.plan.tree_planning import TreePieces, place_tree_pieces, real_units, tree_micro_stats, tree_pieces
from verl_traj.core.sorting import lex_order

__all__ = [
    "GROUP_BY_CHOICES",
    "MINI_BATCH_BALANCE_CHOICES",
    "PAD_UID_PREFIX",
    "PAD_ROW_TOKENS",
    "PlanError",
    "PlanSpec",
    "MiniBatchStats",
    "MiniBatchPlan",
    "assign_units",
    "count_splits",
    "mini_batch_order",
    "padding_items",
    "plan_mini_batches",
]


def mini_batch_order(num_mini_batches: int, epoch: int, seed: int, shuffle: bool) -> torch.Tensor:
    """Order in which the mini-batches of one training batch are stepped in epoch ``epoch``:
    ``[num_mini_batches]`` int64, identical on every rank (depends only on its arguments)."""
    if not shuffle:
        return torch.arange(num_mini_batches, dtype=torch.long)
    g = torch.Generator()
    g.manual_seed((int(seed) * 1_000_003 + int(epoch) * 7919 + 12345) % (2**63 - 1))
    return torch.randperm(num_mini_batches, generator=g)


def assign_units(unit_tokens: np.ndarray, num_mini_batches: int, balance: str, rng: np.random.Generator) -> np.ndarray:
    """``[U]`` tokens per unit -> ``[U]`` mini-batch of each unit (every mini-batch non-empty when U >= M).

    ``"tokens"``: LPT (equal token mass). ``"units"``: quotas of ``U // M`` or ``U // M + 1`` units
    (the larger quotas on seed-chosen mini-batches), LPT on tokens within the quotas."""
    u, m = unit_tokens.shape[0], num_mini_batches
    quota = None
    if balance == "units":
        quota = np.full(m, u // m, dtype=np.int64)
        quota[rng.permutation(m)[: u % m]] += 1
    perm = rng.permutation(u)  # seed-permuted ties among equal unit tokens, and among equal bins
    order = perm[np.argsort(-unit_tokens[perm], kind="stable")]
    return lpt(unit_tokens.astype(np.int64), m, order=order, bin_rank=np.argsort(rng.permutation(m)), quota=quota)


def padding_items(row_mini_batch: np.ndarray, num_mini_batches: int, dp_size: int) -> np.ndarray:
    """``[P]`` mini-batch of each padding row: ``(-n_m) % dp_size`` for mini-batch ``m`` with ``n_m`` rows."""
    n_real = np.bincount(row_mini_batch, minlength=num_mini_batches)
    return np.repeat(np.arange(num_mini_batches, dtype=np.int64), (-n_real) % dp_size)


@dataclass
class _Items:
    """The rows of the output (real rows, then new padding rows), before ordering."""

    src: np.ndarray  # [N] source row, -1 for padding
    mb: np.ndarray  # [N] mini-batch
    tokens: np.ndarray  # [N] attended tokens
    loss: np.ndarray  # [N] loss tokens
    traj: np.ndarray  # [N] dense trajectory, -1 for padding
    grp: np.ndarray  # [N] dense group, -1 for padding
    rank: Optional[np.ndarray] = None  # [N] DP rank, after balancing

    @property
    def pad(self) -> np.ndarray:
        return self.src < 0

    def placed(self, rank: np.ndarray) -> "_Items":
        return _Items(self.src, self.mb, self.tokens, self.loss, self.traj, self.grp, rank)


def _real_items(layout: BatchLayout, spec: PlanSpec, rng: np.random.Generator,
                unit_cost: Optional[np.ndarray] = None) -> tuple[_Items, int]:
    """Stage 1: real rows with their mini-batch (units assigned whole, LPT on ``unit_cost``: default their row
    tokens). Returns (items, units above a fair share)."""
    real, unit, num_units = real_units(layout, spec.group_by)
    tokens = layout.num_tokens.numpy()[real]
    traj = layout.traj_index.numpy()[real]
    grp = layout.group_index.numpy()[real]
    m = int(spec.num_mini_batches)
    if num_units < m:
        what = "groups (distinct uids)" if spec.group_by == "group" else "trajectories"
        raise PlanError(
            f"train batch has {num_units} {what} but {m} mini-batches were configured "
            f"(train_batch_size / ppo_mini_batch_size); each mini-batch is one optimizer step and needs at least "
            f"one whole {'group' if spec.group_by == 'group' else 'trajectory'}, and an empty mini-batch would change "
            "the number of optimizer steps. Fix: lower the number of mini-batches (raise ppo_mini_batch_size), "
            "raise train_batch_size" + (", or use group_by='trajectory'" if spec.group_by == "group" else "") + ".",
            field="num_mini_batches",
        )
    unit_tokens = np.bincount(unit, weights=tokens, minlength=num_units).astype(np.int64) if unit_cost is None \
        else unit_cost
    unit_mb = assign_units(unit_tokens, m, spec.mini_batch_balance, rng)
    larger = int((unit_tokens > unit_tokens.sum() / m).sum())
    loss = layout.num_loss_tokens.numpy()[real]
    return _Items(real.astype(np.int64), unit_mb[unit], tokens, loss, traj, grp), larger


def _with_padding(items: _Items, spec: PlanSpec) -> _Items:
    """Stage 2: append the fewest padding rows that give every rank the same rows per mini-batch."""
    return _appended(items, padding_items(items.mb, int(spec.num_mini_batches), int(spec.dp_size)), spec)


def _appended(items: _Items, pad_mb: np.ndarray, spec: PlanSpec, pad_rank: Optional[np.ndarray] = None) -> _Items:
    """``items`` with padding rows of mini-batches ``pad_mb`` (and ranks ``pad_rank`` when already placed)."""
    p = pad_mb.shape[0]
    fill = np.full(p, -1, dtype=np.int64)
    return _Items(
        src=np.concatenate([items.src, fill]),
        mb=np.concatenate([items.mb, pad_mb]),
        tokens=np.concatenate([items.tokens, np.full(p, int(spec.pad_row_tokens), dtype=np.int64)]),
        loss=np.concatenate([items.loss, np.zeros(p, dtype=np.int64)]),
        traj=np.concatenate([items.traj, fill]),
        grp=np.concatenate([items.grp, fill]),
        rank=None if pad_rank is None else np.concatenate([items.rank, pad_rank]),
    )


def _balance(items: _Items, spec: PlanSpec, rng: np.random.Generator) -> None:
    """Stage 3: DP rank of every item (equal counts per mini-batch)."""
    m, dp = int(spec.num_mini_batches), int(spec.dp_size)
    if spec.balance_dp:
        cost = calculate_workload(items.tokens, spec.workload)
        items.rank = balance_equal_size(cost, items.mb, m, dp, tiebreak=rng.permutation(items.mb.shape[0]))
    else:
        items.rank = round_robin_equal_size(items.mb, m, dp)


def _placed(items: _Items, spec: PlanSpec, rng: np.random.Generator, pieces: Optional[TreePieces]):
    """Stages 2 and 3: ``(items with padding rows and ranks, the tree placement or None)``; with ``pieces`` (a
    prefix-tree plan) whole pieces are placed (:func:`~verl_traj.core.plan.tree_planning.place_tree_pieces`)."""
    if pieces is None:
        items = _with_padding(items, spec)
        _balance(items, spec, rng)
        return items, None
    placement = place_tree_pieces(pieces, items.mb, spec, rng)
    return _appended(items.placed(placement.rank[pieces.of_row]), placement.pad_mb, spec, placement.pad_rank), placement


def _rank_major(items: _Items) -> np.ndarray:
    """Stage 4: output order (rank, mini-batch, padding last, source row)."""
    src_key = np.where(items.pad, np.arange(items.src.shape[0]), items.src)
    return lex_order(src_key, items.pad, items.mb, items.rank)


def plan_mini_batches(
    layout: BatchLayout,
    num_mini_batches: int,
    dp_size: int,
    *,
    partitioner: Optional[Partitioner] = None,
    rows: Optional[Sequence] = None,
    **options,
) -> MiniBatchPlan:
    """Plan one training batch (stages: module docstring). ``options`` are :class:`PlanSpec` fields;
    ``partitioner`` is an extra micro-batch candidate (:func:`~verl_traj.core.packing.packing.min_micro_batches`);
    ``rows``: every row's attended token ids (``prefix_tree=True`` only: stages 3 and 5 then place prefix trees,
    :mod:`verl_traj.core.plan.tree_planning`).

    Raises:
        PlanError: bad spec (a misspelled option, a count that is not a whole number >= 1, NaN cap, an unknown
            choice), or fewer units than mini-batches.
        PackingError: the micro-batch cap is below the longest row.
    """
    if not isinstance(layout, BatchLayout):
        raise PlanError.invalid("layout", layout, "is not a BatchLayout", "pass the result of build_layout(...)")
    check_options("plan_mini_batches (a PlanSpec field)", options, PlanSpec.__dataclass_fields__, error=PlanError)
    if partitioner is not None and not callable(partitioner):
        raise PlanError.invalid("partitioner", partitioner, "is not callable",
                                "pass fn(sizes, k) -> parts (verl's partition), or None")
    spec = PlanSpec(num_mini_batches, dp_size, **options)
    rng = np.random.default_rng(spec.seed)
    clock = _Clock()
    pieces = tree_pieces(layout, spec, rows) if spec.prefix_tree else None
    items, larger = _real_items(layout, spec, rng, None if pieces is None else pieces.unit_tokens)
    clock.lap("units_s")
    items, placement = _placed(items, spec, rng, pieces)
    out = _rank_major(items)
    clock.lap("balance_s")
    stats = _statistics(items, spec)
    split_traj, split_grp = _splits(items)
    clock.lap("stats_s")
    micro_id, micro_stats = (_micro_batches(items, spec, partitioner) if pieces is None
                             else tree_micro_stats(items, pieces, placement, spec))
    clock.lap("packing_s")
    counts = np.bincount(items.mb, minlength=spec.num_mini_batches)
    return MiniBatchPlan(
        order=torch.from_numpy(items.src[out]),
        mini_batch_id=torch.from_numpy(items.mb[out]),
        micro_batch_id=torch.from_numpy(micro_id[out]),
        traj_index=torch.from_numpy(items.traj[out]),
        is_padding=torch.from_numpy(items.pad[out]),
        rows_per_rank=torch.from_numpy((counts // spec.dp_size).astype(np.int64)),
        stats=MiniBatchStats(**{k: torch.from_numpy(v) for k, v in {**stats, **micro_stats}.items()}),
        spec=spec,
        num_source_rows=layout.num_rows,
        units_larger_than_mini_batch=larger,
        split_trajectories=split_traj,
        split_groups=split_grp,
        timing_s=clock.laps,
    )


class _Clock:
    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self._t
        self._t = now


def _block_sum(values: np.ndarray, block: np.ndarray, num_blocks: int) -> np.ndarray:
    """``[num_blocks]`` int64 exact sums of ``values`` per block (no float rounding above 2**53)."""
    out = np.zeros(num_blocks, dtype=np.int64)
    np.add.at(out, block, values.astype(np.int64, copy=False))
    return out


def _statistics(items: _Items, spec: PlanSpec) -> dict[str, np.ndarray]:
    """Stage 5a: per-mini-batch and per-(mini-batch, rank) statistics (padding excluded from real counts)."""
    m, dp = int(spec.num_mini_batches), int(spec.dp_size)
    block = items.mb * dp + items.rank
    real = ~items.pad
    cost = calculate_workload(items.tokens, spec.workload)
    rank_workload = _block_sum(cost, block, m * dp).reshape(m, dp)
    rank_tokens = _block_sum(items.tokens[real], block[real], m * dp).reshape(m, dp)
    rank_loss = _block_sum(items.loss[real], block[real], m * dp).reshape(m, dp)
    max_item = np.zeros(m, dtype=np.int64)
    np.maximum.at(max_item, items.mb, cost)
    n_pad = np.bincount(items.mb[items.pad], minlength=m).astype(np.int64)
    return {
        "real_rows": np.bincount(items.mb[real], minlength=m).astype(np.int64),
        "trajectories": _distinct_per_mb(items.traj[real], items.mb[real], m),
        "groups": _distinct_per_mb(items.grp[real], items.mb[real], m),
        "loss_tokens": rank_loss.sum(1),
        "tokens": rank_tokens.sum(1),
        "padding_rows": n_pad,
        "padding_tokens": n_pad * int(spec.pad_row_tokens),
        "max_rank_workload": rank_workload.max(1),
        "workload_lower_bound": np.maximum(-(-rank_workload.sum(1) // dp), max_item),
        "rank_workload": rank_workload,
        "rank_tokens": rank_tokens,
        "rank_loss_tokens": rank_loss,
    }


def _distinct_per_mb(ids: np.ndarray, mb: np.ndarray, m: int) -> np.ndarray:
    pairs = np.unique(ids * m + mb)
    return np.bincount(pairs % m, minlength=m).astype(np.int64)


def count_splits(traj_index: np.ndarray, group_index: np.ndarray, mini_batch: np.ndarray) -> tuple[int, int]:
    """``(split trajectories, split groups)``: extra mini-batches the rows of a trajectory / a group are spread
    over (distinct (unit, mini-batch) pairs minus units), over the rows given (pass real rows only)."""
    m = int(mini_batch.max()) + 1 if mini_batch.size else 1

    def extra(ids: np.ndarray) -> int:
        return int(_distinct_per_mb(ids, mini_batch, m).sum()) - int(np.unique(ids).size)

    return extra(traj_index), extra(group_index)


def _splits(items: _Items) -> tuple[int, int]:
    """Splits measured on the output: trajectories 0 by construction; groups 0 with ``group_by=group`` and
    counted with ``group_by=trajectory`` (a group's trajectories may then land in several mini-batches)."""
    real = ~items.pad
    return count_splits(items.traj[real], items.grp[real], items.mb[real])


def _micro_batches(items: _Items, spec: PlanSpec,
                   partitioner: Optional[Partitioner]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Stage 5b: micro-batch of every item within its (rank, mini-batch) block, and its statistics."""
    m, dp = int(spec.num_mini_batches), int(spec.dp_size)
    zeros = np.zeros(m, dtype=np.int64)
    n = items.src.shape[0]
    if spec.micro_batch_max_tokens is None:
        empty = {"micro_batches": zeros, "micro_batches_lower_bound": zeros, "max_packed_tokens": zeros,
                 "padded_positions": zeros, "ranks_short_of_rows": zeros}
        return np.zeros(n, dtype=np.int64), empty
    block = items.mb * dp + items.rank
    packing = pack_micro_batches(items.tokens, block, np.arange(m * dp) // dp, m * dp,
                                 int(spec.micro_batch_max_tokens), cost=spec.micro_batch_cost, partitioner=partitioner,
                                 pass_cost=spec.micro_batch_pass_cost)
    key = block * (int(packing.micro_index.max()) + 1) + packing.micro_index
    uniq, inv = np.unique(key, return_inverse=True)
    inv = inv.reshape(-1)
    sums = _block_sum(items.tokens, inv, uniq.shape[0])
    longest = np.zeros(uniq.shape[0], dtype=np.int64)
    np.maximum.at(longest, inv, items.tokens)
    rows = np.bincount(inv, minlength=uniq.shape[0]).astype(np.int64)
    uniq_mb = (uniq // (int(packing.micro_index.max()) + 1)) // dp
    max_packed = np.zeros(m, dtype=np.int64)
    np.maximum.at(max_packed, uniq_mb, sums)
    return packing.micro_index, {
        "micro_batches": packing.block_count.reshape(m, dp).max(1),
        "micro_batches_lower_bound": packing.block_lower_bound.reshape(m, dp).max(1),
        "max_packed_tokens": max_packed,
        "padded_positions": _block_sum(rows * longest - sums, uniq_mb, m),
        "ranks_short_of_rows": packing.ranks_short_of_rows.reshape(m, dp).sum(1).astype(np.int64),
    }
