"""``python -m verl_traj.main_ppo``: verl's PPO/GRPO entry with verl_traj's trainer and workers.

Hydra config: ``configs/traj_ppo.yaml`` (verl's ``ppo_trainer`` plus our ``traj:`` section);
presets such as ``configs/cpu_tiny.yaml`` select with ``--config-name``. Every verl override works
as with ``python -m verl.trainer.main_ppo``.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import hydra
import ray
from omegaconf import OmegaConf

from verl.trainer.main_ppo_v0 import BaseTaskRunner

from verl_traj.config import TrajConfig, validate_against_verl

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = os.environ.get("VERL_TRAJ_CONFIG_DIR", str(REPO_ROOT / "configs"))


class TrajTaskRunnerImpl(BaseTaskRunner):
    """verl's v0 task runner with verl_traj's trainer and worker classes swapped in."""

    def add_actor_rollout_worker(self, config):
        from verl_traj.integration.workers import TrajActorRolloutRefWorker

        actor_rollout_cls, group_cls = super().add_actor_rollout_worker(config)
        for role, cls in list(self.role_worker_mapping.items()):
            if getattr(cls, "__ray_actor_class__", None) is actor_rollout_cls:
                self.role_worker_mapping[role] = ray.remote(TrajActorRolloutRefWorker)
        return TrajActorRolloutRefWorker, group_cls

    def add_critic_worker(self, config):
        from verl.trainer.ppo.ray_trainer import Role

        from verl_traj.integration.workers import TrajCriticWorker

        super().add_critic_worker(config)
        self.role_worker_mapping[Role.Critic] = ray.remote(TrajCriticWorker)

    def run(self, config):
        from pprint import pprint

        from verl.trainer.ppo.utils import create_rl_dataset, create_rl_sampler, need_critic, need_reference_policy
        from verl.utils.config import omega_conf_to_dataclass, validate_config
        from verl.utils.dataset.rl_dataset import collate_fn
        from verl.workers.config import HFModelConfig

        from verl_traj.integration.trainer import TrajRayPPOTrainer

        print(f"verl_traj TaskRunner hostname: {socket.gethostname()}, PID: {os.getpid()}")
        pprint(OmegaConf.to_container(config, resolve=True))
        OmegaConf.resolve(config)

        actor_rollout_cls, ray_worker_group_cls = self.add_actor_rollout_worker(config)
        self.add_critic_worker(config)
        self.add_reward_model_resource_pool(config)
        self.add_teacher_model_resource_pool(config)
        self.add_ref_policy_worker(config, actor_rollout_cls)
        validate_config(
            config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config)
        )

        model_config: HFModelConfig = omega_conf_to_dataclass(config.actor_rollout_ref.model)
        resource_pool_manager = self.init_resource_pool_mgr(config)
        data_cfg = config.data
        train_dataset = create_rl_dataset(
            data_cfg.train_files, data_cfg, model_config.tokenizer, model_config.processor,
            is_train=True, max_samples=data_cfg.get("train_max_samples", -1),
        )
        val_dataset = create_rl_dataset(
            data_cfg.val_files, data_cfg, model_config.tokenizer, model_config.processor,
            is_train=False, max_samples=data_cfg.get("val_max_samples", -1),
        )
        trainer = TrajRayPPOTrainer(
            config=config,
            tokenizer=model_config.tokenizer,
            processor=model_config.processor,
            role_worker_mapping=self.role_worker_mapping,
            resource_pool_manager=resource_pool_manager,
            ray_worker_group_cls=ray_worker_group_cls,
            train_dataset=train_dataset,
            val_dataset=val_dataset,
            collate_fn=collate_fn,
            train_sampler=create_rl_sampler(data_cfg, train_dataset),
        )
        trainer.init_workers()
        trainer.fit()


TrajTaskRunner = ray.remote(num_cpus=1)(TrajTaskRunnerImpl)


def run(config) -> None:
    """Validate ``traj:`` and verl's config on the driver, then run training on Ray."""
    from verl.trainer.main_ppo import run_ppo
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    traj = TrajConfig.from_mapping(config.get("traj"))
    validate_against_verl(traj, config)
    auto_set_device(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    run_ppo(config, task_runner_class=TrajTaskRunner)


@hydra.main(config_path=CONFIG_DIR, config_name="traj_ppo", version_base=None)
def main(config) -> None:
    run(config)


if __name__ == "__main__":
    main()
