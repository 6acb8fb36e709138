"""verl's real engine workers on CPU without Ray, for the engine tests and ``scripts/bench_update.py``.

One process per DP rank (``torch.multiprocessing`` spawn, gloo). The workers are built exactly as
``ActorRolloutRefWorker.init_model`` / the trainer's critic builds them, from ``configs/cpu_tiny.yaml``
and the tiny model of :mod:`verl_traj.cpu.build_tiny`; a planned batch is dispatched as verl's trainer
does (``left_right_2_no_padding``, the update's non-tensor keys, rank ``r`` gets the contiguous block r).

On a CUDA GPU (``scripts/bench_update.py --device cuda``): nccl, one GPU per rank, :func:`gpu_config` (the same
preset without the CPU platform: verl's own GPU defaults, bf16 mixed precision) and, where flash-attn is missing,
:func:`register_torch_varlen` (the flash-attention path in torch, where the prefix-tree attention sits).
"""

from __future__ import annotations

import os
import socket
from functools import partial
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import TrainingWorkerConfig
from verl.workers.engine_workers import TrainingWorker
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import left_right_2_no_padding

from verl_traj.config import TrajConfig
from verl_traj.configs import CONFIG_DIR
from verl_traj.core.keys import IS_PADDING, LOSS_WEIGHT, MINI_BATCH_ID, PLANNED_FIELDS, TRAJ_INDEX, planned_update_fields
from verl_traj.cpu.torch_flash import TORCH_VARLEN, attention_patches  # TORCH_VARLEN: re-exported
from verl_traj.integration.config.update_spec import UpdateSpec
from verl_traj.integration.patches.process import install
from verl_traj.integration.workers.engine_workers import TrajActorTrainingWorker, TrajCriticWorker
from verl_traj.integration.workers.losses import traj_ppo_loss, traj_value_loss
from verl_traj.testing.trainers import ray_less_trainer

__all__ = ["free_port", "init_rank", "compose_config", "cpu_config", "gpu_config", "register_torch_varlen", "TORCH_VARLEN",
           "actor_worker", "critic_worker", "rank_tensordict", "plan_for_update"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank: int, world: int, port: int, home: str, threads: int = 1, device: str = "cpu") -> None:
    """Environment and process group of one spawned rank (verl reads RANK / WORLD_SIZE / ...); ``home`` is
    ``VERL_TRAJ_HOME`` (the presets read the tiny model from its ``tiny/``). ``device="cuda"``: GPU ``rank`` of this
    machine, nccl; else gloo."""
    cuda = device == "cuda"
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank) if cuda else "0",
                       "LOCAL_WORLD_SIZE": str(world) if cuda else "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "VERL_TRAJ_HOME": str(home)})
    torch.set_num_threads(max(1, threads))
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}")


def cpu_config(overrides: Sequence[str] = ()) -> Any:
    """``configs/cpu_tiny.yaml`` with hydra overrides, resolved."""
    return compose_config("cpu_tiny", overrides)


def gpu_config(overrides: Sequence[str] = ()) -> Any:
    """``configs/cpu_tiny.yaml`` without its CPU platform (``~platform``): verl's own GPU defaults (FSDP mixed
    precision bf16 over fp32 parameters, gradient checkpointing, remove-padding), FSDP2 as on CPU; with hydra
    overrides (``actor_rollout_ref.model.path``: the model), resolved. ``override_config.attn_implementation`` is
    there (verl's default, ``flash_attention_2``), so an override can name another, as on CPU."""
    return compose_config("cpu_tiny", ["~platform", "actor_rollout_ref.actor.strategy=fsdp2",
                                       "actor_rollout_ref.actor.fsdp_config.strategy=fsdp2",
                                       "+actor_rollout_ref.model.override_config.attn_implementation=flash_attention_2",
                                       *overrides])


def register_torch_varlen(name: str = TORCH_VARLEN) -> str:
    """transformers' flash-attention path under ``name`` with the torch variable-length kernel where verl's
    remove-padding wrapper calls flash-attn (:mod:`verl_traj.cpu.torch_flash`; the plugin installs the same
    in every CUDA process without flash-attn), installed now in this process; idempotent. Returns ``name``."""
    install(attention_patches(name), on_import=None)
    return name


def compose_config(name: str, overrides: Sequence[str] = (), *, resolve: bool = True) -> Any:
    """A shipped preset (``traj_ppo``: verl's own ``ppo_trainer`` plus ``traj:``) with hydra overrides; with
    ``resolve=False`` verl's interpolations (``${oc.select:actor_rollout_ref.actor...}``) are kept, as the trainer
    receives them."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(config_name=name, overrides=list(overrides))
    if resolve:
        OmegaConf.resolve(cfg)
    return cfg


def _worker(cls: type, model_type: str, model_config: Any, section_config: Any, cap: int, loss_fn: Any) -> Any:
    twc = TrainingWorkerConfig(model_type=model_type, model_config=model_config, engine_config=section_config.engine,
                               optimizer_config=section_config.optim, checkpoint_config=section_config.checkpoint)
    twc.engine_config.use_dynamic_bsz = True
    twc.engine_config.max_token_len_per_gpu = cap
    twc.engine_config.infer_max_token_len_per_gpu = cap
    twc.engine_config.use_remove_padding = model_config.get("use_remove_padding", False)
    worker = cls(config=twc)
    worker.reset()
    worker.set_loss_fn(partial(loss_fn, config=section_config))
    return worker


def actor_worker(cfg: Any, planned: bool) -> Any:
    """The actor's engine worker: ``TrajActorTrainingWorker`` + ``traj_ppo_loss`` or verl's own pair."""
    model_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
    actor_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    actor_config.model_config = model_config
    return _worker(TrajActorTrainingWorker if planned else TrainingWorker, "language_model", model_config, actor_config,
                   int(cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu),
                   traj_ppo_loss if planned else ppo_loss)


def critic_worker(cfg: Any) -> Any:
    """The critic's engine worker (value model): ``TrajCriticWorker`` + ``traj_value_loss``."""
    critic_config = omega_conf_to_dataclass(cfg.critic)
    return _worker(TrajCriticWorker, "value_model", critic_config.model, critic_config,
                   int(cfg.critic.ppo_max_token_len_per_gpu), traj_value_loss)


def plan_for_update(batch: Any, cfg: Any, dp: int, *, mode: str = "token-mean", group_by: str = "group",
                    seed: int = 0, ratio_groups: bool = False, prefix_tree: bool = False, **traj_options: Any) -> Any:
    """What ``TrajRayPPOTrainer`` does to a batch before ``_update_actor``, through the trainer's own code: start-up
    (``UpdateSpec.prepare`` on ``cfg``), ``plan_and_apply`` (plan in place), then the actor's ``loss_weight``
    (``traj.loss_agg_mode=mode``) and the planned-fields list the trainer sends (``ratio_groups``: the actor's
    ``ratio_group`` too, which the caller attaches), left attached. ``prefix_tree``: the micro-batches planned and
    marked as prefix trees, or rows (stated, not ``auto``: the worker the caller built must match). ``traj_options``:
    further ``traj:`` settings. Returns the plan."""
    traj_config = TrajConfig(group_by=group_by, loss_agg_mode=mode, seed=seed, prefix_tree=prefix_tree, **traj_options)
    spec = UpdateSpec.prepare(cfg, traj_config)
    trainer = ray_less_trainer(cfg, traj_config, plan=spec.plan, dp=dp)  # derives the same spec from the prepared cfg
    trainer.global_steps = 0
    plan = trainer.plan_and_apply(batch, dp)
    td = batch.batch
    td[LOSS_WEIGHT] = spec.actor_loss.weights(td["response_mask"], td[MINI_BATCH_ID], td[TRAJ_INDEX], td[IS_PADDING])
    batch.meta_info[PLANNED_FIELDS] = ",".join(planned_update_fields(ratio_groups))
    return plan


def rank_tensordict(batch: Any, rank: int, dp: int, mini_batch_rows: int, *, epochs: int = 1, shuffle: bool = False,
                    extra: Optional[dict] = None) -> Any:
    """Rank ``rank``'s block of ``batch`` as verl's ``_update_actor`` dispatches it."""
    td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(
        td, calculate_entropy=False, global_batch_size=mini_batch_rows, mini_batch_size=mini_batch_rows,
        epochs=epochs, seed=0, dataloader_kwargs={"shuffle": shuffle}, compute_loss=True, temperature=1.0,
        **(extra or {}),
    )
    per = len(batch) // dp
    return tu.index_select_tensor_dict(td, list(range(rank * per, (rank + 1) * per)))
