"""Where verl_traj's losses leave what verl's loss does not compute (issue 40, item 3): device scalars read once per
update, so the loss never waits on the device beyond verl's own ``.item()`` calls.

verl's ``Metric(value=tensor)`` reads its value on the spot (``.item()``: a device-to-host sync per metric per
micro-batch). The metrics verl_traj adds (``*/loss_weight_mass``, ``actor/traj_seq_ratio_shift_abs_max``) and the
non-finite log-ratio counts of GSPO's trajectory ratio go instead into the update's :class:`LossSink`, which the
planned micro-batches carry as the non-tensor :data:`LOSS_SINK` (:mod:`verl_traj.integration.workers.planned_update` puts it there; the same
object on every micro-batch: a ``TensorDict`` moves non-tensor data by reference). The worker reads it when the
update ends (:meth:`LossSink.read`: two all-reduces and one read for the whole update) and reports per optimizer
step what verl's aggregation would have: ``sum`` metrics summed over a step's micro-batches and averaged over the
data-parallel ranks, ``max`` metrics the step's maximum over micro-batches and ranks. A non-finite count raises there,
naming the field. Without a sink (a loss called outside a planned update) :func:`record` and :func:`record_nonfinite`
fall back to verl's immediate ``Metric`` and an immediate check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from verl.utils.metric import AggregationType, Metric

from verl_traj.core.errors import TrajInputError

__all__ = ["LOSS_SINK", "LossSink", "record", "record_nonfinite"]

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
