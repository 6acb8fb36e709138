"""verl_traj's actor and critic workers (thin subclasses of verl's engine workers).

``TrajTrainingWorker.train_mini_batch`` replaces verl's fixed-size slicing with the trainer's plan:
each rank's shard is split by the per-row ``mini_batch_id`` (variable sizes), one ``train_batch``
(= one optimizer step) per mini-batch and epoch, in the same (seeded, optionally shuffled) mini-batch
ORDER on every rank, ``update_lr_scheduler`` only on the very last step. Batches without
``mini_batch_id`` (``traj.enable=false``) take verl's own path unchanged.

The loss: ``TrajActorRolloutRefWorker.init_model`` installs ``traj_ppo_loss`` (verl's ``ppo_loss``
when a batch carries no ``loss_weight``); the critic's ``traj_value_loss`` is set by the trainer
through ``set_loss_fn``, as verl does for ``value_loss``.
"""

from __future__ import annotations

import logging
import os
from functools import partial
from itertools import chain

import torch
from codetiming import Timer
from tensordict import NonTensorData, TensorDict

from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from verl.utils import tensordict_utils as tu
from verl.utils.metric.utils import Metric
from verl.utils.py_functional import append_to_dict
from verl.utils.tensordict_utils import maybe_fix_3d_position_ids
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

logger = logging.getLogger(__file__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))

MINI_BATCH_ID_KEY = "mini_batch_id"


def mini_batch_order(num_mini_batches: int, epoch: int, seed: int, shuffle: bool) -> torch.Tensor:
    """The plan's per-epoch mini-batch order (identical on every rank: depends only on its args)."""
    from verl_traj.core import mini_batch_order as core_order

    return core_order(num_mini_batches, epoch, seed, shuffle)


def split_by_mini_batch_id(mini_batch_id: torch.Tensor) -> dict[int, torch.Tensor]:
    """``{id: local row indices}`` in ascending id order (ids are the plan's 0..M-1)."""
    ids = mini_batch_id.detach().cpu().long()
    out = {}
    for m in torch.unique(ids).tolist():
        out[int(m)] = torch.nonzero(ids == m, as_tuple=False).reshape(-1)
    return out


class TrajTrainingWorker(TrainingWorker):
    """verl's ``TrainingWorker`` whose ``train_mini_batch`` follows the trainer's ``mini_batch_id``."""

    def _plan_mini_batches(self, data: TensorDict) -> tuple[int, dict[int, torch.Tensor]]:
        """Local rows of every mini-batch; checks every DP rank holds rows of the same mini-batches."""
        local = split_by_mini_batch_id(data[MINI_BATCH_ID_KEY])
        local_max = max(local) if local else -1
        group = self.engine.get_data_parallel_group()
        dp = self.engine.get_data_parallel_size()
        counts = [int(local[m].numel()) if m in local else 0 for m in range(local_max + 1)]
        if dp > 1 and torch.distributed.is_initialized():
            gathered = [None] * dp
            torch.distributed.all_gather_object(gathered, counts, group=group)
        else:
            gathered = [counts]
        num_mb = max(len(c) for c in gathered)
        for m in range(num_mb):
            per_rank = [c[m] if m < len(c) else 0 for c in gathered]
            if 0 in per_rank:
                raise RuntimeError(
                    f"mini-batch {m} has rows on some DP ranks but not on others (rows per rank: {per_rank}). "
                    "Every rank must hold rows of every mini-batch: the batch must come from "
                    "TrajRayPPOTrainer._balance_batch (rank-major plan with padding rows), unmodified."
                )
        return num_mb, local

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="train"), blocking=False)
    def train_mini_batch(self, data: TensorDict) -> TensorDict:
        if MINI_BATCH_ID_KEY not in data.keys():
            return super().train_mini_batch(data)

        maybe_fix_3d_position_ids(data)
        disable_auto_offload = tu.pop(data, key="disable_auto_offload", default=False)
        # verl's fixed-size keys are meaningless for a planned batch: drop them
        tu.pop(data, key="mini_batch_size", default=None)
        tu.pop(data, key="num_mini_batch", default=None)
        epochs = int(tu.pop(data, key="epochs", default=1))
        seed = int(tu.pop(data, key="seed", default=42))
        dataloader_kwargs = tu.pop(data, key="dataloader_kwargs", default={}) or {}
        shuffle = bool(dataloader_kwargs.get("shuffle", False))

        num_mb, local_rows = self._plan_mini_batches(data)
        total_steps = num_mb * epochs
        dp_group = self.engine.get_data_parallel_group()

        with (
            self.engine.train_mode(disable_auto_offload=disable_auto_offload),
            Timer(name="train_batch", logger=None),
        ):
            output_lst = []
            step = 0
            for epoch in range(epochs):
                # the same order on every rank (seeded by seed and epoch only, never by rank)
                for m in mini_batch_order(num_mb, epoch, seed, shuffle).tolist():
                    mini_batch_td = tu.index_select_tensor_dict(data, local_rows[m])
                    maybe_fix_3d_position_ids(mini_batch_td)
                    if "input_ids" in mini_batch_td:
                        global_token_num = mini_batch_td["input_ids"].offsets().diff().tolist()
                        gathered = [None] * torch.distributed.get_world_size(dp_group)
                        torch.distributed.all_gather_object(gathered, global_token_num, dp_group)
                        global_token_num = [x for xs in gathered for x in xs]
                    else:
                        global_token_num = None
                    tu.assign_non_tensor(
                        mini_batch_td,
                        global_token_num=NonTensorData(global_token_num),
                        update_lr_scheduler=step == total_steps - 1,
                        disable_auto_offload=True,
                    )
                    with torch.profiler.record_function(f"mini_batch{step}"):
                        output = self.train_batch(mini_batch_td)
                    self.profiler.step()
                    output_lst.append(output)
                    step += 1

            if self.engine.is_mp_src_rank_with_outputs():
                metrics = {}
                for output in [tu.get(o, "metrics") for o in output_lst]:
                    for key, val in output.items():
                        if isinstance(val, list):
                            output[key] = (
                                Metric.aggregate_dp(val) if isinstance(val[0], Metric) else list(chain.from_iterable(val))
                            )
                    append_to_dict(metrics, output)
                rows = [int(local_rows[m].numel()) for m in range(num_mb)]
                metrics["num_optimizer_steps"] = [step]
                metrics["num_mini_batches"] = [num_mb]
                metrics["local_rows_per_mini_batch_min"] = [min(rows)]
                metrics["local_rows_per_mini_batch_max"] = [max(rows)]
                output = tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": metrics}).cpu()
            else:
                output = None
        return output


class TrajCriticWorker(TrajTrainingWorker):
    """The critic: verl's ``TrainingWorker`` (value model) with mini-batch-id aware training."""


class TrajActorRolloutRefWorker(ActorRolloutRefWorker):
    """verl's hybrid actor/rollout/ref worker with ``TrajTrainingWorker`` as the actor and
    ``traj_ppo_loss`` as the actor loss."""

    actor_worker_cls = TrajTrainingWorker

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        super().init_model()
        # verl set ``partial(ppo_loss, config=actor_config)``; keep the same config object. Distillation
        # keeps verl's loss (the trainer refuses traj.enable=true with distillation).
        if self.actor is not None and not self.distillation_enabled and isinstance(self.loss_fn, partial):
            from verl_traj.integration.losses import traj_ppo_loss

            self.loss_fn = partial(traj_ppo_loss, config=self.loss_fn.keywords["config"])
            self.actor.set_loss_fn(self.loss_fn)


__all__ = ["TrajActorRolloutRefWorker", "TrajCriticWorker", "TrajTrainingWorker", "split_by_mini_batch_id"]
