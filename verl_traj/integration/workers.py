"""verl_traj's actor and critic workers: verl's engine workers, told which mini-batches and micro-batches to run.

These workers run planned updates only (the trainers install them with ``traj.enable=true``; stock runs keep
verl's). A planned update is a contract (:func:`check_planned_update`): the trainer names the per-row fields it
planned in the update's ``traj_planned_fields`` (:func:`~verl_traj.core.keys.planned_update_fields`), and a worker
that receives an update without that list, or missing any field it names, raises, naming the field -- never
verl's path in silence (once, on v1, a field the batch meta did not name never reached the workers and the losses
quietly became verl's).

A planned batch runs through verl's own ``TrainingWorker.train_mini_batch`` with two names swapped for the
duration of the call (:func:`verl_traj.integration.patches.update_patches`):

* ``make_iterator`` yields the plan's mini-batches -- the contiguous blocks of each rank's rows with one
  ``mini_batch_id`` (the rank-major layout guarantees contiguity), in a seeded per-epoch order that
  is the same on every rank -- instead of verl's fixed-size slices (whose shuffle differs per rank);
* ``prepare_micro_batches`` of the FSDP engine returns the plan's micro-batches (``micro_batch_id``)
  instead of re-cutting them.

Everything else (the loss, the token gathering for MFU, the metrics, the profiler) is verl's. verl's
learning-rate schedule steps on its last fixed-size iteration; the planned update has fewer iterations,
so :class:`PlannedUpdate` steps it once after the last optimizer step instead (verl's own step when the
counts happen to agree).

The loss: ``TrajActorRolloutRefWorker.init_model`` installs ``traj_ppo_loss``; the critic's ``traj_value_loss`` is
set by the trainer through ``set_loss_fn``, as verl does for ``value_loss``. Both require ``loss_weight``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Optional

import torch
from tensordict import TensorDict

from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from verl.utils import tensordict_utils as tu
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

from verl_traj.core import mini_batch_order
from verl_traj.core.errors import TrajInputError
from verl_traj.core.keys import (MICRO_BATCH_ID, MINI_BATCH_ID, OLD_LOG_PROBS_AT_START, PLANNED_FIELDS, RATIO_GROUP,
                                 SEQ_RATIO_SHIFT)
from verl_traj.integration.actor_sequence_ratios import stochastic_in_training, trajectory_ratio_shift
from verl_traj.integration.losses import traj_ppo_loss
from verl_traj.integration.patches import gspo_prepass_patches, patched, update_patches

__all__ = ["PlannedUpdate", "TrajActorMixin", "TrajActorRolloutRefWorker", "TrajActorTrainingWorker", "TrajCriticWorker",
           "TrajTrainingWorker", "check_planned_update", "mini_batch_slices", "traj_actor_worker"]

# non-tensor key the trainer sets when the critic steps on unions of the actor's mini-batches
CRITIC_UNION_KEY = "traj_critic_union"


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
            "trainer wrote it, but it did not reach this worker. On v1 the workers fetch exactly the fields the "
            "batch meta (KVBatchMeta.fields) names. Fix: name every planned field in the meta after writing it "
            "(verl_traj's trainer does; a subclass that rebuilds the meta must keep them).", field=missing[0])
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
            "batch must come from TrajRayPPOTrainer._balance_batch (rank-major plan), unmodified."
        )
    ends = torch.cumsum(counts, 0).tolist()
    return list(zip([0] + ends[:-1], ends))


def _micro_batch_parts(data: TensorDict) -> list[torch.Tensor]:
    """Row positions of each planned micro-batch of a mini-batch (``(mini_batch_id, micro_batch_id)`` pairs,
    so a union of mini-batches keeps each one's micro-batches)."""
    micro = data[MICRO_BATCH_ID].detach().cpu().long()
    key = data[MINI_BATCH_ID].detach().cpu().long() * (int(micro.max()) + 1) + micro
    _, inverse = torch.unique(key, return_inverse=True)
    order = torch.argsort(inverse, stable=True)
    return list(torch.split(order, torch.bincount(inverse).tolist()))


@dataclass
class PlannedUpdate:
    """One planned ``train_mini_batch``: the fields it was planned with, the iterator and micro-batches it runs, and
    what they did (the GSPO pre-pass's micro-batches counted apart from the planned ones)."""

    seed: int
    fields: tuple[str, ...]
    union: int = 1
    old_log_probs_at_start: bool = False  # the trainer's word (OLD_LOG_PROBS_AT_START)
    micro_batches_run: list[int] = field(default_factory=list)
    steps: int = 0
    steps_started: int = 0  # optimizer steps begun (forward_backward calls that train)
    prepass_micro_batches: int = 0
    prepass_skipped: int = 0
    in_prepass: bool = False

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
            parts = _micro_batch_parts(data)
            if self.in_prepass:
                self.prepass_micro_batches += len(parts)
            else:
                self.micro_batches_run.append(len(parts))
            return [tu.index_select_tensor_dict(data, idx) for idx in parts], [idx.tolist() for idx in parts]

        return prepare_micro_batches

    def metrics(self, epochs: int) -> dict[str, list]:
        runs, epochs = self.micro_batches_run, max(epochs, 1)
        out = {"num_optimizer_steps": [self.steps], "num_mini_batches": [self.steps // epochs]}
        if runs:  # an engine that cut its own micro-batches (Megatron) reports its own, not ours
            out.update(micro_batches_per_epoch=[sum(runs) / epochs], micro_batches_per_mini_batch_max=[max(runs)])
        if self.ratio_groups:  # GSPO at trajectory scope: the extra no-grad forwards, apart from the plan's
            out.update(prepass_micro_batches_per_epoch=[self.prepass_micro_batches / epochs],
                       prepass_skipped_steps=[self.prepass_skipped])
        return out


def _fixed_size_arithmetic(data: TensorDict, dp_size: int) -> int:
    """Make verl's fixed-size bookkeeping pass (one row per rank per iteration); returns verl's iteration count
    per epoch (rows per rank), which decides whether verl steps the LR schedule itself."""
    tu.pop(data, key="num_mini_batch", default=None)
    tu.pop(data, key="mini_batch_size", default=None)
    tu.assign_non_tensor(data, mini_batch_size=dp_size)
    return int(data.shape[0])


class TrajTrainingWorker(TrainingWorker):
    """verl's ``TrainingWorker`` that runs the trainer's planned mini-batches and micro-batches."""

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="train"), blocking=False)
    def train_mini_batch(self, data: TensorDict) -> TensorDict:
        run = PlannedUpdate(seed=int(tu.get(data, key="seed", default=42)), fields=check_planned_update(data),
                            union=int(tu.pop(data, key=CRITIC_UNION_KEY, default=1)),
                            old_log_probs_at_start=bool(tu.pop(data, key=OLD_LOG_PROBS_AT_START, default=False)))
        epochs = int(tu.get(data, key="epochs", default=1))
        verl_iterations = _fixed_size_arithmetic(data, self.engine.get_data_parallel_size()) * epochs
        with patched(self._update_patches(run)):
            output = super().train_mini_batch(data)
        lr = self.engine.lr_scheduler_step() if run.steps < verl_iterations else None  # verl did not step it
        if output is None:
            return output
        metrics = dict(tu.get(output, "metrics"))
        metrics.update(run.metrics(epochs))
        if lr is not None:
            metrics["lr"] = [lr]
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": metrics}).cpu()

    def _update_patches(self, run: PlannedUpdate) -> list:
        """What one planned update swaps in verl (:mod:`verl_traj.integration.patches`)."""
        return update_patches(run.make_iterator, run.prepare_micro_batches)


class TrajActorTrainingWorker(TrajTrainingWorker):
    """The actor: :class:`TrajTrainingWorker` plus GSPO at trajectory scope. When the update is planned with
    ``ratio_group`` (``traj.ratio_scope=trajectory``, step rows, ``loss_mode=gspo``, some trajectory of several
    rows), each optimizer step first runs one no-grad forward over its mini-batch (the plan's micro-batches, the
    parameters of this step, the training forward's mode and random numbers: the RNG state is replayed, so dropout
    draws the same masks), sums each trajectory's log-ratios over its rows on every rank (one all-reduce), and gives
    the loss each row's ``seq_ratio_shift`` (:mod:`verl_traj.stepwise.ratios`): GSPO's sequence ratio over the whole
    trajectory, wherever its rows sit. The first optimizer step of an update skips it where the trainer says the old
    log-probs came from the update's starting parameters and the forward is deterministic (every log-ratio is
    rounding there). The engine's
    ``forward_backward_batch`` is wrapped on the instance for the update (:func:`~verl_traj.integration.patches.
    gspo_prepass_patches`), because only there does verl's data carry the engine settings ``train_batch`` injects."""

    def _update_patches(self, run: PlannedUpdate) -> list:
        patches = super()._update_patches(run)
        if run.ratio_groups:
            patches += gspo_prepass_patches(self.engine, partial(self._with_sequence_ratios, run))
        return patches

    def _with_sequence_ratios(self, run: PlannedUpdate, verl_forward_backward: Callable) -> Callable:
        def forward_backward(batch: TensorDict, loss_function: Callable, forward_only: bool = False):
            if not forward_only:
                first, run.steps_started = run.steps_started == 0, run.steps_started + 1
                if first and run.old_log_probs_at_start and not self._stochastic():
                    run.prepass_skipped += 1
                else:
                    batch[SEQ_RATIO_SHIFT] = self._sequence_ratio_shift(run, verl_forward_backward, batch)
            return verl_forward_backward(batch, loss_function, forward_only=forward_only)

        return forward_backward

    def _stochastic(self) -> bool:
        if not hasattr(self, "_stochastic_forward"):
            self._stochastic_forward = stochastic_in_training(getattr(self.engine, "module", None))
        return self._stochastic_forward

    def _sequence_ratio_shift(self, run: PlannedUpdate, verl_forward_backward: Callable,
                              batch: TensorDict) -> torch.Tensor:
        """``[b]`` shift of each row's old log-probs from a pre-pass in the training forward's mode, its random
        numbers replayed for the training forward (:func:`~.actor_sequence_ratios.trajectory_ratio_shift`)."""
        run.in_prepass = True
        try:
            return trajectory_ratio_shift(verl_forward_backward, batch, self.engine.get_data_parallel_group())
        finally:
            run.in_prepass = False


class TrajCriticWorker(TrajTrainingWorker):
    """The critic: verl's ``TrainingWorker`` (value model) running the planned mini-batches.

    A value model built from a policy checkpoint gets a new, randomly initialised value head; verl draws it from
    the process's unseeded RNG, so two runs of one config started with different critics. The head is drawn
    from the engine config's ``seed`` instead (regression: tests/e2e/test_reproducible.py, the two-rank PPO run)."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def reset(self):
        torch.manual_seed(int(getattr(self.engine_config, "seed", 42)))
        return super().reset()


class TrajActorMixin:
    """The actor side of verl_traj for any of verl's actor workers: ``TrajTrainingWorker`` as the actor and
    ``traj_ppo_loss`` as its loss (first base: ``class W(TrajActorMixin, SomeActorWorker)``)."""

    actor_worker_cls = TrajActorTrainingWorker

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        super().init_model()
        # verl set ``partial(ppo_loss, config=actor_config)``; keep the same config object. Distillation
        # keeps verl's loss (the trainer refuses traj.enable=true with distillation).
        if self.actor is None or self.distillation_enabled:
            return
        if not isinstance(self.loss_fn, partial) or "config" not in self.loss_fn.keywords:
            raise TrajInputError(
                f"{type(self).__name__}.loss_fn is {self.loss_fn!r}, not verl's partial(ppo_loss, config=...): "
                "verl_traj cannot install traj_ppo_loss with the actor's config, and verl's loss would ignore the "
                "planned loss weights. Fix: build the actor's loss as verl's ActorRolloutRefWorker.init_model does, "
                "or set traj.enable=false for this worker class.", field="loss_fn")
        self.loss_fn = partial(traj_ppo_loss, config=self.loss_fn.keywords["config"])
        self.actor.set_loss_fn(self.loss_fn)


class TrajActorRolloutRefWorker(TrajActorMixin, ActorRolloutRefWorker):
    """verl's hybrid actor/rollout/ref worker with verl_traj's actor (:class:`TrajActorMixin`)."""


def traj_actor_worker(verl_cls: type) -> type:
    """verl_traj's version of the actor worker class a trainer chose: ``TrajActorRolloutRefWorker`` for verl's
    ``ActorRolloutRefWorker``, ``Traj<Name>`` for a subclass of it (v1 ``separate_async``'s
    ``DetachActorWorker``). Cached, so Ray sees one class per name."""
    if verl_cls is ActorRolloutRefWorker or issubclass(verl_cls, TrajActorMixin):
        return TrajActorRolloutRefWorker if verl_cls is ActorRolloutRefWorker else verl_cls
    if not issubclass(verl_cls, ActorRolloutRefWorker):
        raise TypeError(f"{verl_cls.__name__} is not one of verl's ActorRolloutRefWorker classes; verl_traj cannot "
                        "install its actor into it. Set traj.enable=false for this worker class.")
    if verl_cls not in _TRAJ_ACTOR_CLASSES:
        _TRAJ_ACTOR_CLASSES[verl_cls] = type(f"Traj{verl_cls.__name__}", (TrajActorMixin, verl_cls),
                                             {"__module__": __name__})
    return _TRAJ_ACTOR_CLASSES[verl_cls]


_TRAJ_ACTOR_CLASSES: dict[type, type] = {}
