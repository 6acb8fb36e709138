"""Start-up adaptation of verl's micro-batch settings, on verl's own config with its interpolations (``traj_ppo``:
verl 0.9.1's ``ppo_trainer`` plus ``traj:``), as the trainer receives it. Each test is a regression of issue 21."""

from __future__ import annotations

import pytest

from verl_traj.config import TrajConfig
from verl_traj.integration.verl_config import prepare_config
from verl_traj.testing.engine import compose_config

# traj_ppo's estimator is verl's default, gae: the critic is on unless a test picks grpo
LONG = ["data.max_prompt_length=8192", "data.max_response_length=8192", "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=2"]


def _prepared(overrides, **traj):
    cfg = compose_config("traj_ppo", LONG + list(overrides), resolve=False)
    return cfg, prepare_config(cfg, TrajConfig(**traj))


def test_fixed_micro_batches_become_a_per_gpu_cap_under_ulysses():
    """A fixed micro-batch of 2 rows runs on one SP group of 4 GPUs (each holds a quarter of each row): 2 x 16K / 4
    = 8,192 tokens per GPU. Converting it to 2 x 16K per GPU (verl then multiplies by 4 for the group) quadrupled the
    memory bound."""
    cfg, plan = _prepared(["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_dynamic_bsz=false",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
                           "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
                           "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4"])
    arr = cfg.actor_rollout_ref
    assert arr.actor.use_dynamic_bsz and arr.actor.ppo_max_token_len_per_gpu == 8192
    assert arr.rollout.log_prob_use_dynamic_bsz and arr.rollout.log_prob_max_token_len_per_gpu == 8192
    assert arr.ref.log_prob_max_token_len_per_gpu == 8192
    assert plan.max_tokens == 8192 * 4  # the cap per SP group: the fixed micro-batch's 2 rows of 16K


def test_the_critic_is_converted_on_its_own_settings():
    """verl's critic.use_dynamic_bsz interpolates the actor's flag: once the actor was switched, the critic looked
    dynamic and kept verl's default 32,768-token cap, 16x its fixed micro-batch of one 2K row."""
    cfg, plan = _prepared(["data.max_prompt_length=1024", "data.max_response_length=1024",
                           "algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_dynamic_bsz=false",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
                           "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
                           "critic.ppo_micro_batch_size_per_gpu=1"])
    assert cfg.critic.use_dynamic_bsz
    # the value pass's cap verl 0.9.1 reads (critic.ppo_infer_*; the yaml's forward_* keys are unread)
    assert cfg.critic.ppo_max_token_len_per_gpu == cfg.critic.ppo_infer_max_token_len_per_gpu == 2048
    assert cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == 4096
    assert plan.max_tokens == 2048  # the smaller of actor and critic


def test_the_training_cap_leaves_the_inference_caps_alone():
    """traj.micro_batch_max_tokens is the update's cap. verl's log-prob and value-pass caps interpolate the actor's /
    critic's training cap, so writing it once made the log-prob cap 4096 too."""
    cfg, plan = _prepared(["algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_dynamic_bsz=true",
                           "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20000"], micro_batch_max_tokens=16384)
    arr = cfg.actor_rollout_ref
    assert arr.actor.ppo_max_token_len_per_gpu == cfg.critic.ppo_max_token_len_per_gpu == 16384 == plan.max_tokens
    assert arr.rollout.log_prob_max_token_len_per_gpu == arr.ref.log_prob_max_token_len_per_gpu == 20000
    assert cfg.critic.get("ppo_infer_max_token_len_per_gpu", None) is None  # verl's CriticConfig default (32768), untouched
    cfg, _ = _prepared(["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_dynamic_bsz=true"],
                       micro_batch_max_tokens=16384,
                       infer_micro_batch_max_tokens=24000)
    assert cfg.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu == 24000  # only when asked
    cfg, _ = _prepared(["actor_rollout_ref.actor.use_dynamic_bsz=true"], infer_micro_batch_max_tokens=24000)
    assert cfg.critic.ppo_infer_max_token_len_per_gpu == 24000  # the critic's value pass too (gae: critic on)


def test_megatron_plans_no_micro_batches_and_reports_none():
    """Regression (issue 21): on Megatron the engine cuts its own micro-batches (its pipeline schedule), yet the
    traj_plan/micro_batch* metrics described planned ones and the worker reported 0 micro-batches run."""
    from verl_traj.core import build_layout_from_counts
    from verl_traj.integration.step_plan import plan_layout, plan_step_metrics
    from verl_traj.integration.workers import PlannedUpdate

    cfg, plan_settings = _prepared(["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.strategy=megatron"])
    assert not plan_settings.engine_runs_plan
    _, fsdp = _prepared(["algorithm.adv_estimator=grpo"])
    assert fsdp.engine_runs_plan
    layout = build_layout_from_counts([30, 50, 20, 40], [10, 20, 5, 15], ["a", "a", "b", "b"])
    for settings, planned in ((plan_settings, False), (fsdp, True)):
        metrics = plan_step_metrics(plan_layout(layout, TrajConfig(), 1, 2, micro=settings), epochs=1)
        assert ("traj_plan/micro_batches" in metrics) == planned
    assert set(PlannedUpdate(seed=0).metrics(epochs=1)) == {"num_optimizer_steps", "num_mini_batches"}


def test_a_gpu_job_is_never_turned_into_a_cpu_job():
    """Regression (issue 21): the CPU plugin picks the CPU platform in any process without an accelerator, so a GPU
    job driven from a CPU-only head node started as a CPU job. Now the driver refuses the mismatch and names the
    switch (VERL_TRAJ_CPU=0, which the GPU launchers set); a CPU preset on a machine with a GPU names the other."""
    from omegaconf import OmegaConf

    from verl_traj.config import TrajConfigError
    from verl_traj.integration.verl_config import check_platform

    gpu_job, cpu_job = (OmegaConf.create({"trainer": {"device": d}}) for d in ("cuda", "cpu"))
    check_platform(gpu_job, "cuda")
    check_platform(cpu_job, "cpu")
    with pytest.raises(TrajConfigError, match="trainer.device='cuda'.*VERL_TRAJ_CPU=0") as err:
        check_platform(gpu_job, "cpu")
    assert err.value.field == "trainer.device"
    with pytest.raises(TrajConfigError, match="VERL_TRAJ_CPU=1"):
        check_platform(cpu_job, "cuda", environ={})


def test_the_gpu_launchers_keep_the_cpu_platform_out():
    """The switch is explicit: both GPU launchers export VERL_TRAJ_CPU=0 (the multi-node job also hands it to every
    Ray worker through the runtime environment) and install through scripts/install.sh --gpu."""
    import os
    import subprocess
    from pathlib import Path

    examples = Path(__file__).resolve().parents[2] / "examples" / "calc_agent"
    gpu = (examples / "run_gpu.sh").read_text()
    assert "export VERL_TRAJ_CPU=0" in gpu and "scripts/install.sh --gpu" in gpu
    env = {**os.environ, "DRY_RUN": "1"}
    submit = subprocess.run(["bash", str(examples / "run_multinode.sh"), "submit"], env=env, capture_output=True,
                            text=True, check=True).stdout
    assert '\\"VERL_TRAJ_CPU\\": \\"0\\"' in submit or '"VERL_TRAJ_CPU": "0"' in submit
    for role in (["head"], ["worker", "127.0.0.1"]):
        out = subprocess.run(["bash", str(examples / "run_multinode.sh"), *role], env=env, capture_output=True,
                             text=True, check=True).stdout
        assert "scripts/install.sh --gpu vllm" in out and "VERL_TRAJ_CPU=0" in out
