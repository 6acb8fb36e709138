"""verl_traj's actor and critic workers: verl's engine workers, told which mini-batches and micro-batches to run.

These workers run planned updates only (the trainers install them with ``traj.enable=true``; stock runs keep
verl's). A planned update is a contract (:func:`check_planned_update`): the trainer names the per-row fields it
planned in the update's ``traj_planned_fields`` (:func:`~verl_traj.core.keys.planned_update_fields`), and a worker
that receives an update without that list, or missing any field it names, raises, naming the field -- never
verl's path in silence (once, on v1, a field the batch meta did not name never reached the workers and the losses
quietly became verl's).

A planned batch runs through verl's own ``TrainingWorker.train_mini_batch`` with two names swapped for the
duration of the call (:func:`verl_traj.integration.patches.scoped.update_patches`):

* ``make_iterator`` yields the plan's mini-batches -- the contiguous blocks of each rank's rows with one
  ``mini_batch_id`` (the rank-major layout guarantees contiguity), in a seeded per-epoch order that
  is the same on every rank -- instead of verl's fixed-size slices (whose shuffle differs per rank);
* ``prepare_micro_batches`` of the engine (its seam, :mod:`verl_traj.integration.engines`: verl's FSDP engine) returns the plan's micro-batches (``micro_batch_id``)
  instead of re-cutting them.

Two steps of the same path where the plan asks for them: a batch marked for the prefix tree runs inside
:func:`~verl_traj.integration.tree.tree_forward.tree_pass` (the engine forwards each micro-batch as its tree); the
actor with GSPO at trajectory scope runs its pre-pass before each optimizer step (:class:`TrajActorTrainingWorker`:
the engine's ``forward_backward_batch``, wrapped for the update). Everything else (the loss function's call, the token
gathering for MFU, the metrics, the profiler) is verl's. verl's
learning-rate schedule steps on its last fixed-size iteration; the planned update has fewer iterations,
so :class:`PlannedUpdate` steps it once after the last optimizer step instead (verl's own step when the
counts happen to agree).

The loss: ``TrajActorRolloutRefWorker.init_model`` installs ``traj_ppo_loss``; ``TrajCriticWorker.set_loss_fn`` installs
``traj_value_loss`` where verl's trainers set ``value_loss``, with the same config. Both require ``loss_weight``. What they
add to verl's loss goes to the update's :class:`~verl_traj.integration.workers.planned_update.LossSink`, read once when
the update ends on every rank (its metrics reported, a non-finite count raised), so no micro-batch waits on the device
beyond verl's own reads.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any, Callable, Optional

import torch
from tensordict import TensorDict

from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from verl.trainer.ppo.utils import Role
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id, get_device_name
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker
from verl.workers.utils.padding import no_padding_2_padding

from verl_traj.core.errors import TrajInputError
from verl_traj.core.keys import (CRITIC_UNION_KEY, OLD_LOG_PROBS_AT_START, RATIO_GROUP, RATIO_IN_LOSS, SEQ_RATIO_SHIFT,
                                 TREE_KEY)
from verl_traj.core.kernels.tree_pass import TreeTotals
from verl_traj.stepwise.ratios import (bounded_group_sums, check_ratio_groups, nonfinite_rows, presummed_ratio_shift,
                                       ratio_group_bound, row_log_ratio_sums, stochastic_in_training)
from verl_traj.integration.engines import engine_of
from verl_traj.integration.patches.scoped import gspo_prepass_patches, micro_batch_patches, patched, update_patches
from verl_traj.integration.tree.tree_forward import tree_metrics, tree_pass
from verl_traj.integration.workers.losses import traj_ppo_loss, traj_value_loss
from verl_traj.integration.workers.planned_update import (LossSink, PlannedUpdate, check_planned_update,
                                                          mini_batch_slices, take_row_fields)

__all__ = ["PlannedUpdate", "TrajActorMixin", "TrajActorRolloutRefWorker", "TrajActorTrainingWorker", "TrajCriticWorker",
           "TrajTrainingWorker", "check_planned_update", "mini_batch_slices", "traj_actor_worker", "traj_role_worker"]


def _fixed_size_arithmetic(data: TensorDict, dp_size: int) -> int:
    """Make verl's fixed-size bookkeeping pass (one row per rank per iteration); returns verl's iteration count
    per epoch (rows per rank), which decides whether verl steps the LR schedule itself."""
    tu.pop(data, key="num_mini_batch", default=None)
    tu.pop(data, key="mini_batch_size", default=None)
    tu.assign_non_tensor(data, mini_batch_size=dp_size)
    return int(data.shape[0])


def tree_marked(data: TensorDict) -> bool:
    """Whether the trainer marked this pass for the prefix-tree forward (the marker only: the pass checks the rest,
    :func:`~verl_traj.integration.tree.tree_forward.tree_pass`)."""
    return bool(tu.get_non_tensor_data(data=data, key=TREE_KEY, default=False))


class TrajTrainingWorker(TrainingWorker):
    """verl's ``TrainingWorker`` that runs the trainer's planned mini-batches and micro-batches."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.engine_seam = engine_of(self.engine)  # resolved once: its engine's seam (integration/engines)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="train"), blocking=False)
    def train_mini_batch(self, data: TensorDict) -> TensorDict:
        take_row_fields(data, self.engine.get_data_parallel_rank())  # v1: the plan's fields shipped with the call
        run = PlannedUpdate(seed=int(tu.get(data, key="seed", default=42)), fields=check_planned_update(data),
                            union=int(tu.pop(data, key=CRITIC_UNION_KEY, default=1)),
                            old_log_probs_at_start=bool(tu.pop(data, key=OLD_LOG_PROBS_AT_START, default=False)),
                            ratio_in_loss=bool(tu.pop(data, key=RATIO_IN_LOSS, default=False)), sink=LossSink())
        epochs = int(tu.get(data, key="epochs", default=1))
        verl_iterations = _fixed_size_arithmetic(data, self.engine.get_data_parallel_size()) * epochs
        if run.ratio_groups:  # checked here, once, on the host copy: the loss and the pre-pass never read it back
            run.group_bound = ratio_group_bound(data.shape[0], self.engine.get_data_parallel_size())
            check_ratio_groups(data[RATIO_GROUP], run.group_bound)
        trees = self._trees(data, lambda: sum(run.micro_batches_run) + run.prepass_micro_batches, "the update")
        with patched(self._update_patches(run)), trees as tree_log:
            output = super().train_mini_batch(data)
        lr = self.engine.lr_scheduler_step() if run.steps < verl_iterations else None  # verl did not step it
        dp_group = self.engine.get_data_parallel_group()
        loss_metrics = run.sink.read(run.steps, dp_group)  # every rank: the sink's one read, its checks
        infer = self._infer_trees.take() if self._infer_trees else None  # every rank: nothing accumulates
        if output is None:
            return output
        metrics = dict(tu.get(output, "metrics"))
        metrics.update(run.metrics(epochs))
        metrics.update(loss_metrics)
        if tree_log is not None:
            metrics.update(tree_metrics(tree_log, infer, dp_group))
        if lr is not None:
            metrics["lr"] = [lr]
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": metrics}).cpu()

    def _update_patches(self, run: PlannedUpdate) -> list:
        """What one planned update swaps in verl (:mod:`verl_traj.integration.patches.scoped`)."""
        return update_patches(run.make_iterator, run.prepare_micro_batches)

    _infer_trees: Optional[TreeTotals] = None  # the trees of this worker's inference passes since its last update

    def _trees(self, data: TensorDict, counts: Callable[[], int], what: str, infer: bool = False) -> Any:
        """:func:`~verl_traj.integration.tree.tree_forward.tree_pass` for a batch marked ``prefix_tree``, else a context
        yielding ``None``; ``infer``: an inference pass, whose trees this worker's next update reports
        (:class:`~verl_traj.core.kernels.tree_pass.TreeTotals`: two numbers, so a reference worker, which never
        updates, holds no growing log)."""
        if not tree_marked(data):
            return contextlib.nullcontext()
        if infer and self._infer_trees is None:
            self._infer_trees = TreeTotals()
        return tree_pass(self.engine, self.engine_seam, data, counts, what, self._infer_trees if infer else None)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="train"), blocking=False)
    def infer_batch(self, data: TensorDict) -> TensorDict:
        """verl's; a batch marked ``prefix_tree`` runs the plan's micro-batches, each as one tree
        (:mod:`verl_traj.integration.tree.tree_forward`)."""
        take_row_fields(data, self.engine.get_data_parallel_rank())
        if not tree_marked(data):
            return super().infer_batch(data)
        run = PlannedUpdate(seed=0, fields=())
        with patched(micro_batch_patches(run.prepare_micro_batches)), \
                self._trees(data, lambda: sum(run.micro_batches_run), "the log-prob pass", infer=True):
            return super().infer_batch(data)


class TrajActorTrainingWorker(TrajTrainingWorker):
    """The actor: :class:`TrajTrainingWorker` plus GSPO at trajectory scope. When the update is planned with
    ``ratio_group`` (``traj.ratio_scope=trajectory``, step rows, ``loss_mode=gspo``, some trajectory of several
    rows), each optimizer step first runs one no-grad forward over its mini-batch (the plan's micro-batches, the
    parameters of this step, the training forward's mode and random numbers: the RNG state is replayed, so dropout
    draws the same masks), sums each trajectory's log-ratios over its rows on every rank (one all-reduce), and gives
    the loss each row's ``seq_ratio_shift`` (:mod:`verl_traj.stepwise.ratios`): GSPO's sequence ratio over the whole
    trajectory, wherever its rows sit. The first optimizer step of an update skips it where the trainer says the old
    log-probs came from the update's starting parameters and the forward is deterministic (every log-ratio is
    rounding there). The engine's ``forward_backward_batch`` is wrapped on the instance for the update
    (:func:`~verl_traj.integration.patches.scoped.gspo_prepass_patches`), because only there does verl's data carry
    the engine settings ``train_batch`` injects."""

    def _update_patches(self, run: PlannedUpdate) -> list:
        patches = super()._update_patches(run)
        if run.ratio_groups and not run.ratio_in_loss:  # in the loss: every trajectory in one micro-batch
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
        """``[b]`` shift of each row's old log-probs, on the device (:func:`~verl_traj.stepwise.ratios.
        presummed_ratio_shift`): verl's ``forward_backward_batch(batch, None, forward_only=True)`` under ``no_grad``
        and a forked RNG (restored on exit, so the training forward draws the same numbers), then each trajectory's
        log-ratio sums (``batch[RATIO_GROUP]`` in ``[-1, run.group_bound)``) over every data-parallel rank (one
        all-reduce). Rows with a non-finite log-prob on a loss token are counted into the update's sink."""
        device = get_device_name()  # the accelerator verl runs on ("cuda", "npu", ...), "cpu" without one
        devices = [] if device == "cpu" else [get_device_id()]
        run.in_prepass = True
        try:  # named in traces, apart from the update's
            with torch.profiler.record_function("traj_gspo_prepass"), torch.no_grad(), \
                    torch.random.fork_rng(devices=devices, device_type=device if devices else "cuda"):
                output = verl_forward_backward(batch, None, forward_only=True)
        finally:
            run.in_prepass = False
        log_prob = no_padding_2_padding(output["model_output"]["log_probs"], batch)
        padded = batch.select("old_log_probs", "response_mask").to_padded_tensor()
        old, mask = padded["old_log_probs"].to(log_prob.device), padded["response_mask"].to(log_prob.device)
        group = batch[RATIO_GROUP].to(log_prob.device).long()
        per_row = row_log_ratio_sums(log_prob, old, mask)
        sums = bounded_group_sums(per_row, group, run.group_bound)
        torch.distributed.all_reduce(sums, op=torch.distributed.ReduceOp.SUM,
                                     group=self.engine.get_data_parallel_group())
        run.sink.add("nonfinite", "old_log_probs", nonfinite_rows(old, mask, group))
        run.sink.add("nonfinite", "log_probs", nonfinite_rows(log_prob, mask, group))
        return presummed_ratio_shift(per_row, group, sums, old.dtype)


class TrajCriticWorker(TrajTrainingWorker):
    """The critic: verl's ``TrainingWorker`` (value model) running the planned mini-batches, with
    ``traj_value_loss`` where verl's trainers set ``value_loss`` (same config object: :meth:`set_loss_fn`).

    A value model built from a policy checkpoint gets a new, randomly initialised value head; verl draws it from
    the process's unseeded RNG, so two runs of one config started with different critics. The head is drawn
    from the engine config's ``seed`` instead (regression: tests/e2e/test_reproducible.py, the two-rank PPO run)."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def reset(self):
        torch.manual_seed(int(getattr(self.engine_config, "seed", 42)))
        return super().reset()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_loss_fn(self, loss_fn):
        """verl's trainers (v0, v1, ``separate_async``) set ``partial(value_loss, config=critic_config)``; the critic
        runs ``traj_value_loss`` with that config (the planned loss weights; verl's would ignore them)."""
        if not isinstance(loss_fn, partial) or "config" not in loss_fn.keywords:
            raise TrajInputError(
                f"{type(self).__name__}.set_loss_fn got {loss_fn!r}, not verl's partial(value_loss, config=...): "
                "verl_traj cannot install traj_value_loss with the critic's config, and another loss would ignore the "
                "planned loss weights. Fix: set the critic's loss as verl's trainers do, or set traj.enable=false.",
                field="loss_fn")
        return super().set_loss_fn(partial(traj_value_loss, config=loss_fn.keywords["config"]))


class TrajActorMixin:
    """The actor side of verl_traj for any of verl's actor workers: ``TrajTrainingWorker`` as the actor and
    ``traj_ppo_loss`` as its loss (first base: ``class W(TrajActorMixin, SomeActorWorker)``)."""

    actor_worker_cls = TrajActorTrainingWorker
    ref_worker_cls = TrajTrainingWorker  # verl's, but for prefix-tree batches (infer_batch)

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
ACTOR_ROLES = (Role.Actor, Role.ActorRollout, Role.ActorRolloutRef, Role.RefPolicy)


def traj_role_worker(role: Role, verl_cls: type) -> Optional[type]:
    """The worker class verl_traj runs for ``role`` where verl's trainer chose ``verl_cls`` (``None``: verl's):
    :class:`TrajCriticWorker` for the critic, :func:`traj_actor_worker` of verl's class for the actor roles."""
    if role == Role.Critic:
        return TrajCriticWorker
    return traj_actor_worker(verl_cls) if role in ACTOR_ROLES else None
