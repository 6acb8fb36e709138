"""A planned update as the workers run it: the plan's per-row fields taken from the call (v1,
:func:`take_row_fields`: its rank's block of what the trainer shipped,
:func:`~verl_traj.integration.trainers.v1_updates.rank_blocks`), the contract check, the plan's mini-batches and
micro-batches, what ran (:class:`PlannedUpdate`) and what its losses recorded (:class:`LossSink`).
:mod:`~verl_traj.integration.workers.engine_workers` swaps these into verl's ``train_mini_batch`` (and, for
prefix-tree batches, ``infer_batch``) for one call.

The micro-batches are cut on the batch's host copy (verl's workers move each micro-batch to the device in
``forward_step``), so what each one needs besides its rows rides along as non-tensor data, read from the host:
a prefix-tree micro-batch's tree size (:data:`~verl_traj.core.keys.TREE_SIZE_KEY`) and the update's loss sink
(:data:`LOSS_SINK`).

The loss sink (issue 40, item 3) is where verl_traj's losses leave what verl's loss does not compute: device
scalars read once per update, so the loss never waits on the device beyond verl's own ``.item()`` calls. verl's
``Metric(value=tensor)`` reads its value on the spot (a device-to-host sync per metric per micro-batch). The
metrics verl_traj adds (``*/loss_weight_mass``, ``actor/traj_seq_ratio_shift_abs_max``) and the non-finite
log-ratio counts of GSPO's trajectory ratio go instead into the update's :class:`LossSink`, the same object on every
planned micro-batch (a ``TensorDict`` moves non-tensor data by reference). The worker reads it when the update ends
(:meth:`LossSink.read`: two all-reduces and one read for the whole update) and reports per optimizer step what
verl's aggregation would have: ``sum`` metrics summed over a step's micro-batches and averaged over the
data-parallel ranks, ``max`` metrics the step's maximum over micro-batches and ranks. A non-finite count raises there,
naming the field. Without a sink (a loss called outside a planned update) :func:`record` and :func:`record_nonfinite`
fall back to verl's immediate ``Metric`` and an immediate check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import ray
import torch
from tensordict import TensorDict

from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric

from verl_traj.core import mini_batch_order
from verl_traj.core.errors import TrajInputError
from verl_traj.core.keys import (MICRO_BATCH_ID, MINI_BATCH_ID, PLANNED_FIELDS, RATIO_GROUP, RATIO_IN_LOSS, ROW_FIELDS,
                                 ROW_LENGTH, TREE_SIZE, TREE_SIZE_KEY)
from verl_traj.core.kernels.tree_pass import micro_batch_tree_sizes

__all__ = ["LOSS_SINK", "LossSink", "PlannedUpdate", "check_planned_update", "mini_batch_slices", "record",
           "record_nonfinite", "row_lengths", "take_row_fields"]

LOSS_SINK = "traj_loss_sink"  # non-tensor of a planned update's micro-batches: the update's LossSink
_KINDS = {"sum": AggregationType.SUM, "max": AggregationType.MAX}


@dataclass
class LossSink:
    """One planned update's device scalars: ``entries`` ``(kind, name, step, 0-d tensor)`` with ``kind`` ``sum`` /
    ``max`` (a metric) or ``nonfinite`` (a count that must be 0; ``name`` the field); ``step``: the optimizer step the
    micro-batches being cut belong to (set by the planned update)."""

    step: int = 0
    entries: list = field(default_factory=list)

    def add(self, kind: str, name: str, value: torch.Tensor) -> None:
        self.entries.append((kind, name, self.step, value.detach().reshape(())))

    def _per_step(self, kind: str, name: str, steps: int) -> torch.Tensor:
        """``[steps]`` float64: the entries of ``(kind, name)`` summed (``max``: maximised) per step."""
        picked = [(s, v) for k, n, s, v in self.entries if (k, n) == (kind, name)]
        device = picked[0][1].device
        index = torch.tensor([s for s, _ in picked], device=device)
        values = torch.stack([v.double() for _, v in picked])
        if kind == "max":
            out = torch.full((steps,), float("-inf"), dtype=torch.float64, device=device)
            return out.scatter_reduce(0, index, values, "amax")
        return torch.zeros(steps, dtype=torch.float64, device=device).index_add_(0, index, values)

    def read(self, steps: int, dp_group: Any = None) -> dict[str, list[float]]:
        """Metrics per optimizer step (``steps`` of them), reduced over the ranks of ``dp_group`` (every rank of it
        calls this); raises :class:`TrajInputError` naming the field of a non-zero ``nonfinite`` count. Empties the
        sink."""
        keys = sorted({(k, n) for k, n, _, _ in self.entries})
        if not keys:
            return {}
        added = [k for k in keys if k[0] != "max"]
        maxed = [k for k in keys if k[0] == "max"]
        parts = [torch.stack([self._per_step(*k, steps) for k in group]) if group else None for group in (added, maxed)]
        self.entries = []
        ranks = 1
        if dp_group is not None and torch.distributed.is_initialized():
            ranks = torch.distributed.get_world_size(dp_group)
            for part, op in zip(parts, (torch.distributed.ReduceOp.SUM, torch.distributed.ReduceOp.MAX)):
                if part is not None:
                    torch.distributed.all_reduce(part, op=op, group=dp_group)
        values = torch.cat([p.reshape(-1) for p in parts if p is not None]).tolist()
        per_key = {k: values[i * steps:(i + 1) * steps] for i, k in enumerate(added + maxed)}
        for (kind, name), row in per_key.items():
            if kind == "nonfinite" and sum(row):
                raise TrajInputError(f"{int(sum(row))} row(s) hold a NaN / inf {name} on a loss token: it poisons "
                                     "the trajectory's GSPO sequence ratio. Fix: check the model and its inputs "
                                     f"(the pass that wrote {name}).", field=name)
        return {name: ([v / ranks for v in row] if kind == "sum" else [v for v in row if v != float("-inf")])
                for (kind, name), row in per_key.items() if kind in _KINDS}


def record(metrics: dict, sink: Optional[LossSink], kind: str, name: str, value: torch.Tensor) -> None:
    """The metric ``name`` (``kind`` ``sum`` / ``max``) of one micro-batch: into ``sink``, else verl's ``Metric``."""
    if sink is None:
        metrics[name] = Metric(value=value.detach(), aggregation=_KINDS[kind])
    else:
        sink.add(kind, name, value)


def record_nonfinite(sink: Optional[LossSink], name: str, count: torch.Tensor) -> None:
    """A count of rows with a non-finite ``name`` that must be 0: into ``sink``, else checked now."""
    if sink is not None:
        sink.add("nonfinite", name, count)
    elif bool(count):
        raise TrajInputError(f"{int(count)} row(s) hold a NaN / inf {name} on a loss token: it poisons the "
                             "trajectory's GSPO sequence ratio. Fix: check the model and its inputs.", field=name)


def row_lengths(data: TensorDict) -> torch.Tensor:
    """``[b]`` int64 each row's attended tokens (``input_ids`` unpadded and nested as v1 stores it, or one dense
    ``[b, L]`` tensor of rows of one length)."""
    ids = data["input_ids"]
    if ids.is_nested:
        return ids.offsets().diff().cpu().long()
    return torch.full((ids.shape[0],), ids.shape[-1], dtype=torch.long)


def take_row_fields(data: TensorDict, dp_rank: int) -> None:
    """Set the plan's per-row fields of this worker's rows on ``data`` from the call's
    :data:`~verl_traj.core.keys.ROW_FIELDS` (popped), if it carries them; nothing otherwise (v0 and tests hand the
    fields in the batch). Raises :class:`TrajInputError` (field ``traj_row_length``) where the block is not these
    rows: another count, or other row lengths (the batch was cut or reordered after planning)."""
    refs = tu.pop(data, key=ROW_FIELDS, default=None)
    if refs is None:
        return
    block = {}
    for part in refs.parts:  # the plan's fields (put once a step), an update's own
        block.update(ray.get(part[dp_rank]))
    want, held = block.pop(ROW_LENGTH), row_lengths(data)
    if want.shape != held.shape or not torch.equal(want.long(), held):
        raise TrajInputError(
            f"data-parallel rank {dp_rank} holds {held.numel()} rows but the plan's fields shipped for it describe "
            f"{want.numel()} rows of other lengths (first lengths held {held.tolist()[:8]}, planned "
            f"{want.tolist()[:8]}): verl did not cut the call's batch into the plan's rank blocks. Fix: hand the "
            "workers the planned meta unmodified (verl_traj's trainer does).", field=ROW_LENGTH)
    for name, value in block.items():
        data[name] = value


def check_planned_update(data: TensorDict) -> tuple[str, ...]:
    """The per-row fields the trainer planned for this update (the non-tensor ``traj_planned_fields``, popped), each
    checked present in ``data``. Raises :class:`TrajInputError` naming the list or the first missing field."""
    listed = tu.pop(data, key=PLANNED_FIELDS, default=None)
    if listed is None:
        raise TrajInputError(
            f"a verl_traj worker received an update without {PLANNED_FIELDS!r}: it was not planned by verl_traj's "
            "trainer (TrajRayPPOTrainer / TrajV1Mixin with traj.enable=true), and verl_traj's workers run planned "
            "updates only. Fix: run through python -m verl_traj.main_ppo with traj.enable=true, or use verl's own "
            "workers for traj.enable=false.", field=PLANNED_FIELDS)
    fields = tuple(name for name in str(listed).split(",") if name)
    keys = set(data.keys())
    missing = [name for name in fields if name not in keys]
    if missing:
        raise TrajInputError(
            f"the planned update lacks field {missing[0]!r} (planned: {list(fields)}; received: {sorted(keys)}): the "
            "trainer planned it, but it did not reach this worker. On v1 the plan's fields travel with the call "
            "(extra_info['traj_row_fields'], taken by take_row_fields); on v0 in the batch. Fix: hand the workers the "
            "planned batch and the call's extra_info unmodified (a subclass that rebuilds them must keep them).",
            field=missing[0])
    return fields


def mini_batch_slices(mini_batch_id: torch.Tensor, union: int = 1) -> list[tuple[int, int]]:
    """``[(start, end)]`` of each optimizer step's rows ``0..M'-1`` in one rank's rows: ``union`` consecutive planned
    mini-batches per step (``id // union``; the critic may step on unions of the actor's mini-batches).

    The plan lays each rank's rows out mini-batch after mini-batch, so every mini-batch is one contiguous
    block; anything else means the batch did not come unmodified from the planner."""
    ids = mini_batch_id.detach().cpu().long() // int(union)
    values, counts = torch.unique_consecutive(ids, return_counts=True)
    if not torch.equal(values, torch.arange(values.numel())):
        raise RuntimeError(
            f"this rank's mini_batch_id blocks are {values.tolist()[:16]}, expected 0, 1, 2, ... in order: the "
            "batch must come from verl_traj's trainer (v0 or v1 _balance_batch: the rank-major plan), unmodified."
        )
    ends = torch.cumsum(counts, 0).tolist()
    return list(zip([0] + ends[:-1], ends))


def _micro_batch_parts(data: TensorDict) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``(row positions of each planned micro-batch of a mini-batch, [b] micro-batch of each row)``: one per
    ``(mini_batch_id, micro_batch_id)`` pair, so a union of mini-batches keeps each one's micro-batches (host ops on
    the ids' host copy; a micro-batch id is below the row count, which bounds the key)."""
    micro = data[MICRO_BATCH_ID].detach().cpu().long()
    key = data[MINI_BATCH_ID].detach().cpu().long() * (micro.shape[0] + 1) + micro
    _, inverse = torch.unique(key, return_inverse=True)
    order = torch.argsort(inverse, stable=True)
    return list(torch.split(order, torch.bincount(inverse).tolist())), inverse


@dataclass
class PlannedUpdate:
    """One planned ``train_mini_batch``: the fields it was planned with, the iterator and micro-batches it runs, and
    what they did (the GSPO pre-pass's micro-batches counted apart from the planned ones)."""

    seed: int
    fields: tuple[str, ...]
    union: int = 1
    old_log_probs_at_start: bool = False  # the trainer's word (OLD_LOG_PROBS_AT_START)
    ratio_in_loss: bool = False  # the trainer's word (RATIO_IN_LOSS): GSPO's trajectory ratio from the live log-probs
    micro_batches_run: list[int] = field(default_factory=list)
    steps: int = 0
    steps_started: int = 0  # optimizer steps begun (forward_backward calls that train)
    prepass_micro_batches: int = 0
    prepass_skipped: int = 0
    in_prepass: bool = False
    sink: Optional[LossSink] = None  # the update's loss sink, on each training micro-batch (:class:`LossSink`)
    group_bound: int = 0  # GSPO at trajectory scope: a bound on the update's trajectories (the pre-pass's table)

    @property
    def ratio_groups(self) -> bool:
        """GSPO at trajectory scope: the rows carry their trajectory as ``ratio_group``."""
        return RATIO_GROUP in self.fields

    def make_iterator(self, _verl_make_iterator: Callable) -> Callable:
        def make_iterator(tensordict: TensorDict, mini_batch_size: Any = None, epochs: int = 1, seed: Any = None,
                          dataloader_kwargs: Optional[dict] = None):
            blocks = mini_batch_slices(tensordict[MINI_BATCH_ID], self.union)
            shuffle = bool((dataloader_kwargs or {}).get("shuffle", False))
            orders = [mini_batch_order(len(blocks), e, self.seed, shuffle).tolist() for e in range(int(epochs))]
            self.steps = len(blocks) * int(epochs)
            return (tu.index_select_tensor_dict(tensordict, torch.arange(*blocks[m])) for o in orders for m in o)

        return make_iterator

    def prepare_micro_batches(self, _verl_prepare: Callable) -> Callable:
        def prepare_micro_batches(data: TensorDict, *args: Any, **kwargs: Any):
            if MICRO_BATCH_ID not in data.keys():
                raise TrajInputError(f"a micro-batch cut was asked for inside a planned update whose rows carry no "
                                     f"{MICRO_BATCH_ID!r}: the planned micro-batches would be lost. The batch must "
                                     "come from verl_traj's trainer unmodified.", field=MICRO_BATCH_ID)
            parts, inverse = _micro_batch_parts(data)
            micro_batches = [tu.index_select_tensor_dict(data, idx) for idx in parts]
            if TREE_SIZE in data.keys():  # prefix trees: each one's size, a host int (no device read in the pass)
                row_sizes = data[TREE_SIZE].cpu()  # a no-op: verl's workers hold a batch on the host until forward_step
                sizes = micro_batch_tree_sizes(row_sizes, inverse, torch.stack([idx[0] for idx in parts]))
                for micro_batch, size in zip(micro_batches, sizes):
                    tu.assign_non_tensor(micro_batch, **{TREE_SIZE_KEY: size})
            if self.in_prepass:
                self.prepass_micro_batches += len(parts)
            else:
                self._to_sink(micro_batches)
                self.micro_batches_run.append(len(parts))
            return micro_batches, [idx.tolist() for idx in parts]

        return prepare_micro_batches

    def _to_sink(self, micro_batches: list) -> None:
        """What the loss reads of the update, on each training micro-batch: the update's loss sink (at the optimizer
        step they belong to) and :attr:`ratio_in_loss` (the worker popped it from the update: read once, here)."""
        if self.sink is not None:
            self.sink.step = len(self.micro_batches_run)
            for micro_batch in micro_batches:
                tu.assign_non_tensor(micro_batch, **{LOSS_SINK: self.sink, RATIO_IN_LOSS: self.ratio_in_loss})

    def metrics(self, epochs: int) -> dict[str, list]:
        runs, epochs = self.micro_batches_run, max(epochs, 1)
        out = {"num_optimizer_steps": [self.steps], "num_mini_batches": [self.steps // epochs]}
        if runs:  # an engine that cut its own micro-batches (Megatron) reports its own, not ours
            out.update(micro_batches_per_epoch=[sum(runs) / epochs], micro_batches_per_mini_batch_max=[max(runs)])
        if self.ratio_groups:  # GSPO at trajectory scope: the extra no-grad forwards, apart from the plan's
            out.update(prepass_micro_batches_per_epoch=[self.prepass_micro_batches / epochs],
                       prepass_skipped_steps=[self.prepass_skipped], ratio_in_loss=[float(self.ratio_in_loss)])
        return out
