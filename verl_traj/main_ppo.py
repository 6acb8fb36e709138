"""``python -m verl_traj.main_ppo``: verl's PPO/GRPO entry with verl_traj's trainer and workers.

Hydra config: ``verl_traj/configs/traj_ppo.yaml`` (verl's ``ppo_trainer`` plus our ``traj:`` section);
presets such as ``cpu_tiny`` select with ``--config-name`` (the configs ship with the package). Every verl override
works as with ``python -m verl.trainer.main_ppo``.
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

# verl imports every optional engine at start-up and warns for each one that is not installed, in every process
# (the driver and each Ray worker): on a machine without them that is five warnings per process before training
# starts. Choosing one of them still fails loudly, where it is built. The driver filters them here; its Ray workers
# through PYTHONWARNINGS (quiet_optional_engine_warnings).
OPTIONAL_ENGINES = ("torchtitan", "veomni", "automodel", "mindspeed", "megatron")
warnings.filterwarnings("ignore", message=rf"({'|'.join(OPTIONAL_ENGINES)}) engine is not available")

import hydra  # noqa: E402
import psutil  # noqa: E402
import ray  # noqa: E402

import verl.trainer.main_ppo as verl_main_ppo  # noqa: E402
import verl.utils.device as verl_device  # noqa: E402
from verl.trainer import main_ppo_v0  # noqa: E402
from verl.trainer.main_ppo import TaskRunnerV1  # noqa: E402
from verl.trainer.main_ppo_v0 import BaseTaskRunner  # noqa: E402
from verl.trainer.ppo.ray_trainer import Role  # noqa: E402
from verl.trainer.ppo.utils import need_critic, need_reference_policy  # noqa: E402
from verl.utils.config import validate_config  # noqa: E402

from verl_traj.config import TrajConfig  # noqa: E402
from verl_traj.integration.config.verl_config import ray_init_address  # noqa: E402
from verl_traj.integration.patches.scoped import patched, task_runner_patches, v1_task_runner_patches  # noqa: E402
from verl_traj.integration.startup.checks import check_startup  # noqa: E402
from verl_traj.integration.trainers.v0 import TrajRayPPOTrainer  # noqa: E402
from verl_traj.integration.trainers.v1 import traj_trainer_class  # noqa: E402
from verl_traj.integration.workers.engine_workers import (TrajActorRolloutRefWorker, TrajCriticWorker,  # noqa: E402
                                                          traj_role_worker)

CONFIG_DIR = os.environ.get("VERL_TRAJ_CONFIG_DIR", str(Path(__file__).resolve().parent / "configs"))


def _verl_task_runner_run():
    """verl's v0 ``TaskRunner.run`` (the function of the class ``ray.remote`` wrapped)."""
    return main_ppo_v0.TaskRunner.__ray_actor_class__.run


class TrajTaskRunnerImpl(BaseTaskRunner):
    """verl's v0 task runner with verl_traj's worker classes (``traj.enable=true``; they run planned updates only,
    stock runs keep verl's), and ``TrajRayPPOTrainer`` where verl's runner builds ``RayPPOTrainer``
    (:func:`verl_traj.integration.patches.scoped.task_runner_patches`)."""

    def add_actor_rollout_worker(self, config):
        actor_rollout_cls, group_cls = super().add_actor_rollout_worker(config)
        if not TrajConfig.of(config).enable:
            return actor_rollout_cls, group_cls
        for role, cls in list(self.role_worker_mapping.items()):
            if getattr(cls, "__ray_actor_class__", None) is actor_rollout_cls:
                self.role_worker_mapping[role] = ray.remote(TrajActorRolloutRefWorker)
        return TrajActorRolloutRefWorker, group_cls

    def add_critic_worker(self, config):
        super().add_critic_worker(config)
        if TrajConfig.of(config).enable:
            self.role_worker_mapping[Role.Critic] = ray.remote(TrajCriticWorker)

    def run(self, config):
        with patched(task_runner_patches(TrajRayPPOTrainer)):
            return _verl_task_runner_run()(self, config)


TrajTaskRunner = ray.remote(num_cpus=1)(TrajTaskRunnerImpl)


class TrajTaskRunnerV1Impl(TaskRunnerV1.__ray_actor_class__):
    """verl's v1 task runner; the trainer class of ``trainer.v1.trainer_mode`` gets verl_traj's mixin
    (:func:`verl_traj.integration.patches.scoped.v1_task_runner_patches`) and the worker class of each role
    (:func:`~verl_traj.integration.workers.engine_workers.traj_role_worker`: the entry wires the workers of both
    trainers, so driver code imports no worker module)."""

    def run(self, config):
        with patched(v1_task_runner_patches(functools.partial(traj_trainer_class, role_worker=traj_role_worker))):
            return super().run(config)


TrajTaskRunnerV1 = ray.remote(num_cpus=1)(TrajTaskRunnerV1Impl)


OPTIONAL_ENGINE_WARNINGS = tuple(f"ignore:{name} engine is not available" for name in OPTIONAL_ENGINES)


def quiet_optional_engine_warnings(environ: dict) -> None:
    """Add the filters of :data:`OPTIONAL_ENGINE_WARNINGS` to ``PYTHONWARNINGS`` (kept: the user's own filters),
    which Ray's workers inherit from the driver."""
    given = [f for f in environ.get("PYTHONWARNINGS", "").split(",") if f]
    environ["PYTHONWARNINGS"] = ",".join(given + [f for f in OPTIONAL_ENGINE_WARNINGS if f not in given])


def transfer_queue_threads(environ: dict) -> None:
    """TransferQueue's storage asks torch for 8 threads and warns, once per transfer, where the machine has fewer
    physical cores (128 warnings a quick-start run on 2 cores): ask for what there is (``TQ_NUM_THREADS``, read by
    Ray's workers, which inherit the driver's environment; the user's own setting wins)."""
    environ.setdefault("TQ_NUM_THREADS", str(min(8, psutil.cpu_count(logical=False) or os.cpu_count() or 1)))


def run(config) -> None:
    """Check ``traj:`` and verl's config on the driver (once:
    :func:`~verl_traj.integration.startup.checks.check_startup`), then run training on Ray. verl's ``run_ppo`` and
    device functions are looked up on their modules at call time (tests replace them there)."""
    check_startup(config, verl_device.get_device_name())  # before verl's auto_set_device rewrites trainer.device
    verl_device.auto_set_device(config)
    if config.trainer.get("device") == "cpu":
        # Ray prestarts one idle Python worker per logical CPU when the driver connects; the CPU presets declare
        # 16 logical CPUs for placement (configs/platform/cpu.yaml), and 16 processes importing verl on a 2-core
        # machine delay start-up. Workers start on demand instead (set the variable to 1 to restore Ray's default).
        os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    quiet_optional_engine_warnings(os.environ)
    transfer_queue_threads(os.environ)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    ray_init_address(config)
    verl_main_ppo.run_ppo(config, task_runner_class=TrajTaskRunnerV1 if config.trainer.get("use_v1", False) else TrajTaskRunner)


@hydra.main(config_path=CONFIG_DIR, config_name="traj_ppo", version_base=None)
def main(config) -> None:
    run(config)


if __name__ == "__main__":
    main()
