"""Real verl CPU training with step-wise rows (run as a script by test_stepwise_e2e.py).

    python tests/stepwise/_stepwise_e2e_main.py <agent_loop_yaml> [hydra overrides...]

Same as ``python -m verl_traj.main_ppo --config-name cpu_tiny`` except that, inside the Ray task
runner, the trainer class gets :class:`StepwiseTrainerMixin` (expansion in ``_balance_batch``,
step-aware advantages in ``fit``) in case the trainer does not wire it itself, and verl's
``tool_agent`` name is re-pointed to :class:`StepwiseToolAgentLoop` via ``agent_loop_config_path``.
"""

import sys

import hydra
import ray

from verl_traj.config import TrajConfig, validate_against_verl
from verl_traj.main_ppo import CONFIG_DIR, TrajTaskRunnerImpl


class StepwiseTaskRunnerImpl(TrajTaskRunnerImpl):
    def run(self, config):
        import verl_traj.integration.trainer as tr
        from verl_traj.integration.stepwise_agent_loop import StepwiseTrainerMixin

        if not issubclass(tr.TrajRayPPOTrainer, StepwiseTrainerMixin):
            tr.TrajRayPPOTrainer = type("StepwiseTrajRayPPOTrainer", (StepwiseTrainerMixin, tr.TrajRayPPOTrainer), {})
        return super().run(config)


def main(argv):
    yaml_path, overrides = argv[0], argv[1:]
    with hydra.initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = hydra.compose("cpu_tiny", overrides=[f"actor_rollout_ref.rollout.agent.agent_loop_config_path={yaml_path}",
                                                   *overrides])
    from verl.trainer.main_ppo import run_ppo
    from verl.utils.device import auto_set_device

    validate_against_verl(TrajConfig.from_mapping(cfg.get("traj")), cfg)
    auto_set_device(cfg)
    run_ppo(cfg, task_runner_class=ray.remote(num_cpus=1)(StepwiseTaskRunnerImpl))


if __name__ == "__main__":
    main(sys.argv[1:])
