"""verl_traj's trainers without Ray or workers, built as production builds them, for the tests and benchmarks of the
planning and update-preparation code: the one builder.

The trainer is the real class (v0 ``TrajRayPPOTrainer``, or ``Traj<Name>`` of a registered v1 trainer class) made by
its real ``__init__`` (``UpdateSpec.prepare`` on the config, then verl's own ``__init__``) from a config composed as
``python -m verl_traj.main_ppo`` composes it: the shipped ``traj_ppo`` preset (verl's ``ppo_trainer`` + ``traj:``)
with the caller's sections as overrides. Only what lies across a process boundary is stood in for, after
``__init__``, with what the code under test reads of it:

* ``actor_rollout_wg`` / ``critic_wg`` (Ray worker groups, built by ``init_workers`` / ``init()``): their cached
  dispatch info, from which the trainers read the data-parallel size;
* v1's ``tokenizer`` (loaded from the model directory by ``init()``; v0 takes it as an argument): pad and EOS ids;
* ``global_steps`` (set by ``fit`` / checkpoint loading).

v0's ``__init__`` takes what verl's task runner builds around it: the tokenizer (the stand-in above), a role mapping
(``ActorRollout``, no worker class: the classes are used by ``init_workers``), an empty resource-pool manager (the
pools are created by ``init_workers``) and datasets for its dataloaders (one-item stand-ins: verl reads no row of them
in ``__init__``). v1's ``__init__`` starts nothing, so it runs as is.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from types import SimpleNamespace
from typing import Any, Mapping, Optional, Union

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from verl.single_controller.ray import ResourcePoolManager
from verl.trainer.ppo.utils import Role

from verl_traj.config import TrajConfig
from verl_traj.configs import CONFIG_DIR
from verl_traj.integration.config.verl_config import PlanSettings
from verl_traj.integration.trainers.v0 import TrajRayPPOTrainer
from verl_traj.integration.trainers.v1 import traj_trainer_class

__all__ = ["production_config", "ray_less_trainer", "worker_group_stand_in"]

# What the tests' configs leave to the preset: GRPO (no critic unless asked for) and token-capped micro-batches
# (the planner then derives its cap from verl's ppo_max_token_len_per_gpu, as production does).
TEST_PRESET = {"algorithm": {"adv_estimator": "grpo"}, "actor_rollout_ref": {"actor": {"use_dynamic_bsz": True}}}


@functools.lru_cache(maxsize=1)
def _shipped_preset() -> Any:
    """``configs/traj_ppo.yaml`` as hydra composes it for ``python -m verl_traj.main_ppo`` (interpolations kept, as
    the trainer receives them); composed once per process, copied per trainer."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="traj_ppo")


def _plan_overrides(plan: PlanSettings) -> dict:
    """The verl / ``traj:`` keys from which ``prepare_config`` derives ``plan`` (FSDP, no sequence parallelism)."""
    arr = {"actor": {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": plan.max_tokens},
           "model": {"use_remove_padding": plan.cost == "tokens"}}
    traj = {"padded_cap": "area" if plan.cost == "padded_area" else "tokens"}
    if not plan.derived:
        traj["micro_batch_max_tokens"] = plan.max_tokens
    return {"actor_rollout_ref": arr, "traj": traj}


def production_config(config: Mapping, traj_config: Union[Mapping, TrajConfig, None] = None, *,
                      plan: Optional[PlanSettings] = None, use_v1: bool = False) -> Any:
    """A config as ``python -m verl_traj.main_ppo`` composes it. ``config``: verl's sections, merged over the shipped
    ``traj_ppo`` preset and :data:`TEST_PRESET`; or a whole composed config (a preset such as ``cpu_tiny``, as
    :func:`~verl_traj.testing.engine.cpu_config` gives it), taken as it is. Then ``traj_config`` (the ``traj:``
    section), ``trainer.use_v1`` and the keys that give ``plan``, merged on top."""
    traj = dataclasses.asdict(traj_config) if isinstance(traj_config, TrajConfig) else dict(traj_config or {})
    composed = isinstance(config, DictConfig) and "trainer" in config and "traj" in config
    base = copy.deepcopy(config) if composed else OmegaConf.merge(copy.deepcopy(_shipped_preset()), TEST_PRESET, config)
    layers = [{"trainer": {"use_v1": use_v1}}, {"traj": traj}] + ([_plan_overrides(plan)] if plan is not None else [])
    return OmegaConf.merge(base, *layers)


def worker_group_stand_in(dp: int) -> SimpleNamespace:
    """A worker group as the trainers read it before dispatching: its dispatch info (rank -> DP rank) cached for
    every mesh they query (``actor``, the critic's ``train``)."""
    return SimpleNamespace(_dispatch_info={"actor": list(range(dp)), "train": list(range(dp))})


def ray_less_trainer(config: Mapping, traj_config: Union[Mapping, TrajConfig, None] = None, *,
                     plan: Optional[PlanSettings] = None, dp: Optional[int] = None, v1_class: Optional[type] = None,
                     pad_token_id: int = 0, eos_token_id: int = 2) -> Any:
    """A trainer over ``config`` (verl's sections, overriding the shipped preset) and ``traj_config`` (the ``traj:``
    section, mapping or ``TrajConfig``), built by its real ``__init__`` (module docstring).

    ``plan``: the micro-batch settings the planner must get (expressed as verl's token-cap keys; checked against what
    start-up derived); None: whatever the config derives. ``dp``: the data-parallel size the worker groups report
    (default 1); ``v1_class``: a registered v1 trainer class (e.g. ``PPOTrainerSync``) instead of v0's."""
    cfg = production_config(config, traj_config, plan=plan, use_v1=v1_class is not None)
    tokenizer = SimpleNamespace(pad_token_id=pad_token_id, eos_token_id=eos_token_id)
    if v1_class is None:
        tr = TrajRayPPOTrainer(cfg, tokenizer=tokenizer, role_worker_mapping={Role.ActorRollout: None},
                               resource_pool_manager=ResourcePoolManager(resource_pool_spec={}, mapping={}),
                               train_dataset=[{}] * int(cfg.data.train_batch_size), val_dataset=[{}], collate_fn=list)
    else:
        tr = traj_trainer_class(v1_class)(cfg)
        tr.tokenizer = tokenizer
    tr.actor_rollout_wg = tr.critic_wg = worker_group_stand_in(dp or 1)
    tr.global_steps = 1
    if plan is not None and tr.spec is not None:  # the requested tree cost model (start-up's is the device's)
        tr.spec = dataclasses.replace(tr.spec, plan=dataclasses.replace(tr.spec.plan, tree_cost=plan.tree_cost))
    if plan is not None and tr.spec is not None and tr.spec.plan != plan:
        raise ValueError(f"the config gives the planner {tr.spec.plan}, not the requested {plan}: a setting of the "
                         "config (a critic's cap, sequence parallelism, Megatron) overrides it")
    return tr
