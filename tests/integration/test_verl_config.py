"""Start-up adaptation of verl's micro-batch settings, on verl's own config with its interpolations (``traj_ppo``:
verl 0.9.1's ``ppo_trainer`` plus ``traj:``), as the trainer receives it. Each test is a regression of issue 21."""

from __future__ import annotations

import logging

import pytest

from verl_traj.config import TrajConfig
from verl_traj.integration.config.verl_config import prepare_config
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
    from verl_traj.integration.trainers.step_plan import plan_layout, plan_step_metrics
    from verl_traj.integration.workers.engine_workers import PlannedUpdate

    cfg, plan_settings = _prepared(["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.strategy=megatron"])
    assert not plan_settings.engine_runs_plan
    _, fsdp = _prepared(["algorithm.adv_estimator=grpo"])
    assert fsdp.engine_runs_plan
    layout = build_layout_from_counts([30, 50, 20, 40], [10, 20, 5, 15], ["a", "a", "b", "b"])
    for settings, planned in ((plan_settings, False), (fsdp, True)):
        metrics = plan_step_metrics(plan_layout(layout, TrajConfig(), 1, 2, micro=settings), epochs=1)
        assert ("traj_plan/micro_batches" in metrics) == planned
    assert set(PlannedUpdate(seed=0, fields=()).metrics(epochs=1)) == {"num_optimizer_steps", "num_mini_batches"}


def test_a_second_engine_is_one_seam():
    """Issue 54, item 5: what is engine-specific is one registered seam per engine. FSDP's serves ``fsdp`` / ``fsdp2``;
    a strategy without one (Megatron) is refused for trees naming the field; a toy seam registered here gets planned
    micro-batches, its module's ``prepare_micro_batches`` patched and its engine class's tree hooks, and nothing
    else had to change."""
    import sys
    import types

    from verl_traj.config import TrajConfigError
    from verl_traj.integration.engines import (ENGINES, FSDP, EngineSeam, engine_of, planned_strategies, register_engine,
                                               tree_strategies)
    from verl_traj.integration.patches.scoped import micro_batch_patches, tree_forward_patches
    from verl_traj.integration.startup.tree_checks import check_prefix_tree

    assert FSDP.strategies == ("fsdp", "fsdp2") == planned_strategies() == tree_strategies()  # Megatron: none
    cfg = _cpu(TREE + ["actor_rollout_ref.actor.strategy=megatron"])
    with pytest.raises(TrajConfigError, match="strategy='megatron'") as err:
        check_prefix_tree(TrajConfig.from_mapping(cfg.traj), cfg, "cpu")
    assert err.value.field == "actor_rollout_ref.actor.strategy"
    toy_engine = type("ToyEngine", (), {"__module__": "toy_engine"})
    toy = register_engine(EngineSeam("toy", ("toy",), micro_batch_modules=("toy_engine",),
                                     tree_engine="toy_engine.ToyEngine"))
    sys.modules["toy_engine"] = types.ModuleType("toy_engine")
    try:
        assert _prepared(["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.strategy=toy"])[1].engine_runs_plan
        assert "toy_engine" in {p.module for p in micro_batch_patches(lambda mb: mb)}
        assert engine_of(toy_engine()) is toy and engine_of(object()) is None  # what a worker resolves once
        hooks = (lambda verl: verl, lambda verl: verl)
        assert {p.module for p in tree_forward_patches(toy_engine(), toy.tree_engine, *hooks)} == {toy.tree_engine}
        with pytest.raises(ValueError, match="already have a seam"):
            register_engine(EngineSeam("toy2", ("fsdp2",)))
    finally:
        del ENGINES["toy"], sys.modules["toy_engine"]


def test_a_gpu_job_is_never_turned_into_a_cpu_job():
    """Regression (issue 21): the CPU plugin picks the CPU platform in any process without an accelerator, so a GPU
    job driven from a CPU-only head node started as a CPU job. Now the driver refuses the mismatch and names the
    switch (VERL_TRAJ_CPU=0, which the GPU launchers set); a CPU preset on a machine with a GPU names the other."""
    from omegaconf import OmegaConf

    from verl_traj.config import TrajConfigError
    from verl_traj.integration.startup.checks import check_platform

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


# ---------------------------------------------------------------------------------------------------------------------
# Start-up checks (issue 28): no silently wrong mode on the CPU platform, no late failure that start-up can see
# ---------------------------------------------------------------------------------------------------------------------
# what a new user types for Ulysses SP on CPU (docs/gpu.md): no attention override
ULYSSES_USER = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.model.use_remove_padding=true",
                "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"]
RMPAD = "actor_rollout_ref.model.use_remove_padding"
ACTOR_ATTN = "actor_rollout_ref.model.override_config.attn_implementation"
CRITIC_ATTN = "critic.model.override_config.attn_implementation"


def _cpu(overrides=(), name="cpu_tiny"):
    return compose_config(name, list(overrides), resolve=False)


def _attn(cfg, field):
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, field)


@pytest.mark.parametrize("overrides, name, actor, critic", [
    (ULYSSES_USER, "cpu_tiny", "cpu_varlen", None),  # the plain command: the flash-attention path Ulysses wraps
    ([], "cpu_tiny", "sdpa", None),
    (["actor_rollout_ref.model.use_remove_padding=true"], "cpu_tiny", "sdpa", None),  # packed sdpa is exact on CPU
    (ULYSSES_USER + ["critic.model.use_remove_padding=true", "critic.fsdp.ulysses_sequence_parallel_size=2"],
     "cpu_tiny_ppo", "cpu_varlen", "cpu_varlen"),
    (["actor_rollout_ref.model.override_config.attn_implementation=eager"], "cpu_tiny_ppo", "eager", "sdpa"),  # kept
    (ULYSSES_USER + [f"{ACTOR_ATTN}=cpu_varlen"], "cpu_tiny", "cpu_varlen", None),
])
def test_the_cpu_platform_selects_the_attention_ulysses_needs(overrides, name, actor, critic):
    """Regression (issue 28): Ulysses SP=2 on the CPU presets trained on sdpa, each rank attending to its own slice
    of the sequence (rollout vs actor log-probs 4.3e-4 apart, first gradient norm 1.1% off the dp=2 run) unless the
    user knew a second override. Now an unset attention is chosen at start-up for actor / reference and critic."""
    from verl_traj.integration.startup.cpu_settings import select_cpu_attention

    cfg = _cpu(overrides, name)
    written = select_cpu_attention(cfg)
    assert _attn(cfg, ACTOR_ATTN) == actor and _attn(cfg, CRITIC_ATTN) == critic
    assert (f"{ACTOR_ATTN}={actor}" in written) == (f"{ACTOR_ATTN}=" not in " ".join(overrides))


def test_the_reference_model_counts_for_the_shared_attention():
    """The reference loads the actor's model config: a KL run whose reference alone runs Ulysses gets cpu_varlen."""
    from verl_traj.integration.startup.cpu_settings import select_cpu_attention

    cfg = _cpu(["actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2",
                "actor_rollout_ref.actor.use_kl_loss=true"])
    select_cpu_attention(cfg)
    assert _attn(cfg, ACTOR_ATTN) == "cpu_varlen"


@pytest.mark.parametrize("overrides, name, field, value", [
    (ULYSSES_USER + [f"{ACTOR_ATTN}=sdpa"], "cpu_tiny", ACTOR_ATTN, "sdpa"),
    (ULYSSES_USER + [f"{ACTOR_ATTN}=eager"], "cpu_tiny", ACTOR_ATTN, "eager"),
    (ULYSSES_USER + ["critic.model.use_remove_padding=true", "critic.fsdp.ulysses_sequence_parallel_size=2",
                     f"{CRITIC_ATTN}=sdpa"], "cpu_tiny_ppo", CRITIC_ATTN, "sdpa"),
    ([f"{ACTOR_ATTN}=flash_attention_2"], "cpu_tiny", ACTOR_ATTN, "flash_attention_2"),  # CUDA-only: fails to load
    ([f"{CRITIC_ATTN}=flash_attention_2"], "cpu_tiny_ppo", CRITIC_ATTN, "flash_attention_2"),  # quietly sdpa before
])
def test_an_attention_wrong_on_cpu_is_refused_naming_field_value_and_fix(overrides, name, field, value):
    from verl_traj.config import TrajConfigError
    from verl_traj.integration.startup.cpu_settings import select_cpu_attention

    with pytest.raises(TrajConfigError) as err:
        select_cpu_attention(_cpu(overrides, name))
    assert err.value.field == field
    assert f"{field}={value!r}" in str(err.value) and "Fix:" in str(err.value)
    assert "cpu_varlen" in str(err.value)


@pytest.mark.parametrize("overrides, field", [
    (["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", f"{RMPAD}=false"],
     "actor_rollout_ref.model.use_remove_padding"),
    (["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2",
      f"{RMPAD}=false"], "actor_rollout_ref.model.use_remove_padding"),  # the engine key: verl's validate_config does not see it
    (["trainer.n_gpus_per_node=2", "critic.model.use_remove_padding=false",
      "critic.fsdp.ulysses_sequence_parallel_size=2"], "critic.model.use_remove_padding"),
])
def test_ulysses_without_remove_padding_is_refused_at_start_up(overrides, field):
    """verl's engine refuses Ulysses without remove-padding when the workers start (minutes in)."""
    from verl_traj.config import TrajConfigError
    from verl_traj.integration.startup.checks import check_sequence_parallel

    with pytest.raises(TrajConfigError, match=f"Fix: add {field}=true") as err:
        check_sequence_parallel(_cpu(overrides, "cpu_tiny_ppo"))
    assert err.value.field == field


@pytest.mark.parametrize("overrides, refused", [
    (["actor_rollout_ref.model.lora_rank=8"], True),
    (["actor_rollout_ref.model.lora.rank=8"], True),  # verl reads either key
    (["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora.merge=true"], False),
    ([], False),
])
def test_lora_on_the_cpu_rollout_needs_merge(overrides, refused):
    """Regression (issue 28): LoRA without model.lora.merge passed start-up and failed at the first weight sync (the
    CPU rollout takes full weights only), 90 seconds in."""
    from verl_traj.config import TrajConfigError
    from verl_traj.integration.startup.cpu_settings import check_cpu_rollout_lora

    cfg = _cpu(overrides)
    if not refused:
        check_cpu_rollout_lora(cfg)
        return
    with pytest.raises(TrajConfigError, match=r"Fix: add actor_rollout_ref.model.lora.merge=true") as err:
        check_cpu_rollout_lora(cfg)
    assert err.value.field == "actor_rollout_ref.model.lora.merge"


def test_every_estimator_verl_dispatches_is_accepted_and_a_typo_is_refused():
    """Regression (issue 28): algorithm.adv_estimator=simply passed start-up and failed after the first rollout with
    verl's "Unknown advantage estimator simply: simply". The known names are verl's registry (and the enum values its
    compute_advantage dispatches by name)."""
    from verl_traj.config import TrajConfigError
    from verl_traj.integration.startup.checks import check_adv_estimator, known_adv_estimators

    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, AdvantageEstimator

    known = known_adv_estimators()
    assert set(known) == set(ADV_ESTIMATOR_REGISTRY) | {e.value for e in AdvantageEstimator}
    assert {"gae", "grpo", "reinforce_plus_plus", "rloo", "opo", "grpo_passk", "gpg", "remax"} <= set(known)
    for name in known:  # (gigpo, verl_traj's own, runs on step rows)
        check_adv_estimator({"algorithm": {"adv_estimator": name, "gdpo_reward_keys": ["a", "b"]},
                             "trainer": {"use_v1": False}, "traj": {"step_wise": True},
                             "actor_rollout_ref": {"actor": {"calculate_sum_pi_squared": True}}})
    for typo, hint in (("simply", ""), ("GRPO", ""), ("rlo", "did you mean 'rloo'?")):
        with pytest.raises(TrajConfigError, match="is not an advantage estimator verl knows") as err:
            check_adv_estimator({"algorithm": {"adv_estimator": typo}})
        assert err.value.field == "algorithm.adv_estimator" and "'gae'" in str(err.value) and hint in str(err.value)


def test_estimators_that_fail_after_the_first_rollout_on_this_trainer_are_refused():
    from verl_traj.config import TrajConfigError
    from verl_traj.integration.startup.checks import check_adv_estimator

    for name in ("remax", "gdpo", "optimal_token_baseline", "tir_optimal_token_baseline"):  # v1 never fetches inputs
        with pytest.raises(TrajConfigError, match=f"'{name}' needs .*trainer.use_v1=false"):
            check_adv_estimator({"algorithm": {"adv_estimator": name, "gdpo_reward_keys": ["a"]},
                                 "trainer": {"use_v1": True},
                                 "actor_rollout_ref": {"actor": {"calculate_sum_pi_squared": True}}})
    with pytest.raises(TrajConfigError, match="gdpo_reward_keys=") as err:
        check_adv_estimator({"algorithm": {"adv_estimator": "gdpo"}, "trainer": {"use_v1": False}})
    assert err.value.field == "algorithm.gdpo_reward_keys"
    with pytest.raises(TrajConfigError, match="calculate_sum_pi_squared=true") as err:
        check_adv_estimator({"algorithm": {"adv_estimator": "optimal_token_baseline"}})
    assert err.value.field == "actor_rollout_ref.actor.calculate_sum_pi_squared"


@pytest.fixture
def started(monkeypatch, tmp_path):
    """``verl_traj.main_ppo.run`` on a CPU preset up to where training would start: returns the config handed to
    verl's ``run_ppo`` (the model directory is a stub: nothing loads weights before Ray)."""
    import verl.trainer.main_ppo as verl_main
    import verl.utils.device as device

    from verl_traj import main_ppo

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(device, "get_device_name", lambda: "cpu")
    monkeypatch.setenv("PYTHONWARNINGS", "")
    monkeypatch.setenv("RAY_prestart_worker_first_driver", "0")
    handed = []
    monkeypatch.setattr(verl_main, "run_ppo", lambda config, **_: handed.append(config))

    def start(overrides):
        cfg = _cpu([f"actor_rollout_ref.model.path={tmp_path}", *overrides])
        main_ppo.run(cfg)
        return handed[-1]

    return start


@pytest.mark.parametrize("overrides, field", [
    (ULYSSES_USER + [f"{ACTOR_ATTN}=sdpa"], ACTOR_ATTN),
    (["actor_rollout_ref.model.lora_rank=8"], "actor_rollout_ref.model.lora.merge"),
    (["algorithm.adv_estimator=simply"], "algorithm.adv_estimator"),
    (["algorithm.adv_estimator=simply", "traj.enable=false"], "algorithm.adv_estimator"),
])
def test_main_ppo_refuses_before_training_starts(started, overrides, field):
    from verl_traj.config import TrajConfigError

    with pytest.raises(TrajConfigError) as err:
        started(overrides)
    assert err.value.field == field


def test_main_ppo_trains_the_plain_ulysses_command_on_cpu_varlen(started):
    cfg = started(ULYSSES_USER)
    assert _attn(cfg, ACTOR_ATTN) == "cpu_varlen"


def test_validation_runs_once_on_the_driver_and_the_trainer_only_adapts(monkeypatch):
    """The checks run in one place (``check_startup``, from ``main_ppo.run``); the trainer's ``prepare_config``
    adapts and re-validates nothing."""
    from verl_traj.integration.startup import checks as startup

    calls = []
    monkeypatch.setattr(startup, "validate_against_verl", lambda *a: calls.append(a))
    cfg = compose_config("traj_ppo", LONG + ["algorithm.adv_estimator=grpo"], resolve=False)
    prepare_config(cfg, TrajConfig())
    assert calls == []
    monkeypatch.setattr(startup, "check_platform", lambda *a: None)
    monkeypatch.setattr(startup, "check_models", lambda *a: None)
    startup.check_startup(cfg, "cuda")
    assert len(calls) == 1


TREE = ["traj.prefix_tree=true", "actor_rollout_ref.model.use_remove_padding=true"]


def test_prefix_tree_selects_the_cpu_flash_attention_path(started, tmp_path):
    """``traj.prefix_tree=true`` on the CPU platform: the actor's model (and the critic's, with one) gets cpu_varlen
    (the kernel the tree attention replaces), not sdpa, which would read a tree as separate sequences."""
    from verl_traj.integration.startup.tree_checks import check_prefix_tree

    assert _attn(started(TREE), ACTOR_ATTN) == "cpu_varlen"
    cfg = _cpu(TREE + ["algorithm.adv_estimator=gae", "critic.model.use_remove_padding=true",
                       f"actor_rollout_ref.model.path={tmp_path}", f"critic.model.path={tmp_path}"],
               name="cpu_tiny_ppo")
    check_prefix_tree(TrajConfig.from_mapping(cfg.traj), cfg, "cpu")
    assert _attn(cfg, ACTOR_ATTN) == _attn(cfg, CRITIC_ATTN) == "cpu_varlen"


@pytest.mark.parametrize("overrides, field", [
    (["traj.prefix_tree=true", f"{RMPAD}=false"], "actor_rollout_ref.model.use_remove_padding"),
    (TREE + ["traj.enable=false"], "traj.enable"),
    (TREE + ["algorithm.adv_estimator=gae", "critic.model.use_remove_padding=false"], "critic.model.use_remove_padding"),
    (TREE + [f"{ACTOR_ATTN}=sdpa"], ACTOR_ATTN),
    (TREE + ["algorithm.adv_estimator=gae", "critic.model.use_remove_padding=true", f"{CRITIC_ATTN}=sdpa"],
     CRITIC_ATTN),
    (TREE + ["actor_rollout_ref.model.use_fused_kernels=true"], "actor_rollout_ref.model.use_fused_kernels"),
    (TREE + ["traj.prefix_tree=maybe"], "traj.prefix_tree"),
])
def test_prefix_tree_refused_where_it_is_not_built(started, overrides, field):
    """Each refusal names the field to change (and says traj.prefix_tree=false is the other way out)."""
    from verl_traj.config import TrajConfigError

    with pytest.raises(TrajConfigError) as err:
        started(overrides)
    assert err.value.field == field
    assert "prefix_tree" in str(err.value)



@pytest.mark.parametrize("overrides, trees, attn", [
    ([], True, "cpu_varlen"),  # the CPU preset (remove-padding): trees, on the flash-attention path's CPU kernel
    ([f"{RMPAD}=false"], False, "sdpa"),  # verl's padded path: rows, the CPU attention as before
    ([f"{RMPAD}=true", f"{ACTOR_ATTN}=sdpa"], False, "sdpa"),  # an attention the tree cannot take: rows
    ([f"{RMPAD}=true", "+actor_rollout_ref.model.override_config.attention_dropout=0.1"], False, "sdpa"),
    ([f"{RMPAD}=true", "+actor_rollout_ref.model.override_config.sliding_window=8",
      "+actor_rollout_ref.model.override_config.use_sliding_window=true"], False, "sdpa"),
    ([f"{RMPAD}=true", "traj.enable=false"], False, "sdpa"),
])
def test_prefix_tree_auto_is_settled_at_start_up_and_said(started, caplog, overrides, trees, attn):
    """``traj.prefix_tree=auto`` (the default) leaves start-up as ``true`` where the tree is exact and served, else
    ``false``, in the config the trainer and workers get, with one line saying which and why."""
    import logging

    with caplog.at_level(logging.WARNING, logger="verl_traj.integration.startup.checks"):
        cfg = started(overrides)
    assert cfg.traj.prefix_tree is trees and _attn(cfg, ACTOR_ATTN) == attn
    said = [r.getMessage() for r in caplog.records if "traj.prefix_tree=auto" in r.getMessage()]
    assert len(said) == 1 and ("prefix trees" in said[0] if trees else "rows, because" in said[0])


@pytest.mark.parametrize("extra, field", [
    ("+actor_rollout_ref.model.override_config.attention_dropout=0.1",
     "actor_rollout_ref.model.override_config.attention_dropout"),
    ("+actor_rollout_ref.model.override_config.attn_logit_softcapping=30.0",
     "actor_rollout_ref.model.override_config.attn_logit_softcapping"),
])
def test_prefix_tree_true_refuses_what_the_model_needs_at_start_up(started, extra, field):
    """Dropout, a sliding window, soft-capping: refused before any rollout (not inside the first tree pass)."""
    from verl_traj.config import TrajConfigError

    with pytest.raises(TrajConfigError) as err:
        started([*TREE, extra])
    assert err.value.field == field and "traj.prefix_tree=false" in str(err.value)


def test_a_trainer_built_without_start_up_settles_auto_itself(tmp_path):
    """A script that builds the trainer's config without ``main_ppo`` gets the same choice, not rows in silence."""
    from verl_traj.integration.startup.tree_checks import settled_traj_config

    (tmp_path / "config.json").write_text("{}")
    cfg = _cpu([f"actor_rollout_ref.model.path={tmp_path}"])
    assert cfg.traj.prefix_tree == "auto" and settled_traj_config(cfg).trees and cfg.traj.prefix_tree is True
    assert not settled_traj_config(_cpu([f"{RMPAD}=false", f"actor_rollout_ref.model.path={tmp_path}"])).trees


def test_a_hub_id_is_checked_from_the_local_cache_or_trains_on_rows(started, tmp_path, monkeypatch, caplog):
    """Issue 55, item 2: a model given as a hub id is read from the local Hugging Face cache at start-up (a sliding
    window there is refused for ``true``, before any rollout); one whose config cannot be read offline takes rows under
    ``auto``, saying why, and is refused under ``true``, naming ``model.path``."""
    import logging

    import huggingface_hub.constants as hub

    from verl_traj.config import TrajConfigError

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = tmp_path / "hub" / "models--org--windowed" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"sliding_window": 4096, "use_sliding_window": true}')
    (tmp_path / "hub" / "models--org--windowed" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--windowed" / "refs" / "main").write_text("abc")
    with pytest.raises(TrajConfigError) as err:
        started([*TREE, "actor_rollout_ref.model.path=org/windowed"])
    assert err.value.field == "actor_rollout_ref.model.override_config.use_sliding_window"
    with pytest.raises(TrajConfigError, match="none readable offline") as err:
        started([*TREE, "actor_rollout_ref.model.path=org/not-downloaded"])
    assert err.value.field == "actor_rollout_ref.model.path"
    with caplog.at_level(logging.WARNING, logger="verl_traj.integration.startup.checks"):
        cfg = started([f"{RMPAD}=true", "actor_rollout_ref.model.path=org/not-downloaded"])
    assert cfg.traj.prefix_tree is False
    assert any("rows, because" in r.getMessage() and "model.path" in r.getMessage() for r in caplog.records)


SEPARATE = ["trainer.v1.trainer_mode=separate_async"]
SYNC_STEP = "trainer.v1.separate_async.parameter_sync_step"
SYNC_BACKEND = "actor_rollout_ref.rollout.checkpoint_engine.backend"


def test_separate_async_on_cpu_gets_a_rollout_pool_gloo_sync_and_verls_sync_step(started):
    """The user's one override on the CPU preset (train_batch_size 8, ppo_mini_batch_size 4): the sync step verl's
    rule allows (8 / 4 = 2), a standalone rollout pool, weight sync over gloo, logical GPUs for both pools."""
    cfg = started(SEPARATE)
    assert cfg.trainer.v1.separate_async.parameter_sync_step == 2
    assert cfg.actor_rollout_ref.rollout.nnodes == 1 and cfg.actor_rollout_ref.rollout.checkpoint_engine.backend == "gloo"
    assert cfg.ray_kwargs.ray_init.num_gpus == 2
    assert cfg.actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module == "verl_traj.cpu.weight_sync"
    plain = started([])  # the other modes keep the colocated sync and no rollout pool
    assert plain.actor_rollout_ref.rollout.nnodes == 0 and plain.actor_rollout_ref.rollout.checkpoint_engine.backend == "naive"


@pytest.mark.parametrize("overrides, field, says", [
    ([f"{SYNC_STEP}=4"], SYNC_STEP, f"Fix: set {SYNC_STEP}=2"),  # verl's default: 8 != 4 x 4
    ([f"{SYNC_STEP}=3", "data.train_batch_size=6"], SYNC_STEP, "Fix: set data.train_batch_size=12"),
    (["data.train_batch_size=6"], "data.train_batch_size", "not a multiple of actor_rollout_ref.actor.ppo_mini_batch_size=4"),
    ([f"{SYNC_BACKEND}=nccl"], SYNC_BACKEND, f"Fix: set {SYNC_BACKEND}=gloo"),
])
def test_separate_async_refusals_name_verls_rule_and_the_fix(started, overrides, field, says):
    from verl_traj.config import TrajConfigError

    with pytest.raises(TrajConfigError) as err:
        started(SEPARATE + overrides)
    assert err.value.field == field and says in str(err.value), str(err.value)


def test_the_sync_trainer_refills_failed_groups_exactly_with_traj_enabled(started):
    """traj.failed_groups drops and replaces failed groups: on v1's sync mode that needs verl's exact refill
    (one-prompt dataloader fetches); stock verl (traj.enable=false) keeps verl's default."""
    assert started([]).trainer.v1.sampler.sync_refill_failed_groups is True
    assert started(["traj.enable=false"]).trainer.v1.sampler.sync_refill_failed_groups is False
    assert started(SEPARATE).trainer.v1.sampler.sync_refill_failed_groups is False  # async modes refill exactly


@pytest.mark.parametrize("override, field", [("traj.trajectory_timeout_s=30", "traj.trajectory_timeout_s"),
                                             ("traj.failed_groups=keep_survivors", "traj.failed_groups"),
                                             ("traj.replay_poll_s=0.5", "traj.replay_poll_s")])
def test_failure_settings_only_v1_serves_are_refused_on_v0(started, override, field):
    from verl_traj.config import TrajConfigError

    with pytest.raises(TrajConfigError, match="trainer.use_v1=true") as err:
        started(["trainer.use_v1=false", override])
    assert err.value.field == field


@pytest.mark.parametrize("overrides", [["traj.max_staleness=2"], ["traj.max_staleness=2", "traj.stale_groups=defer"]])
def test_staleness_settings_are_refused_on_v0(started, overrides):
    from verl_traj.config import TrajConfigError

    with pytest.raises(TrajConfigError, match="trainer.use_v1=true") as err:
        started(["trainer.use_v1=false", *overrides])
    assert err.value.field == "traj.max_staleness"


@pytest.mark.parametrize("overrides, says", [(["traj.max_staleness=2"], "no effect on trainer.v1.trainer_mode=sync"),
                                             (["traj.max_staleness=2", "traj.enable=false"], "not applied"),
                                             (SEPARATE + ["traj.max_staleness=2"], None)])
def test_a_staleness_bound_that_cannot_act_is_said_at_start_up(started, caplog, overrides, says):
    with caplog.at_level(logging.WARNING, logger="verl_traj.integration.startup.checks"):
        started(overrides)
    said = [r.getMessage() for r in caplog.records if "max_staleness" in r.getMessage()]
    assert (said and says in said[0]) if says else not said, said


CORRECT = SEPARATE + ["traj.max_staleness=1", "traj.stale_groups=correct"]


@pytest.mark.parametrize("overrides, field", [
    (CORRECT, "algorithm.rollout_correction.rollout_is"),
    (CORRECT + ["algorithm.rollout_correction.rollout_is=token", "actor_rollout_ref.rollout.calculate_log_probs=false"],
     "actor_rollout_ref.rollout.calculate_log_probs")])
def test_correct_is_refused_without_the_rollout_correction_it_trains_stale_tokens_under(started, overrides, field):
    from verl_traj.config import TrajConfigError

    with pytest.raises(TrajConfigError, match=r"traj.stale_groups=correct.*Fix: set") as err:
        started(overrides)
    assert err.value.field == field


def test_correct_turns_verls_own_drop_off_and_says_so(started, caplog):
    """verl's default bound (8 versions, drop) would cut the longest trajectories that ``correct`` keeps."""
    with caplog.at_level(logging.WARNING, logger="verl_traj.integration.startup.checks"):
        config = started(CORRECT + ["algorithm.rollout_correction.rollout_is=token"])
    assert config.trainer.v1.sampler.max_off_policy_threshold is None and config.traj.stale_groups == "correct"
    said = [r.getMessage() for r in caplog.records if "max_off_policy_threshold" in r.getMessage()]
    assert said and "max_off_policy_threshold=8 -> null" in said[0], said


def test_a_staleness_bound_below_one_version_is_refused_with_the_fix(started):
    from verl_traj.config import TrajConfigError

    with pytest.raises(TrajConfigError, match=r"traj.max_staleness.*0.5.*at least 1.*Fix: set a number >= 1") as err:
        started(SEPARATE + ["traj.max_staleness=0.5"])
    assert err.value.field == "traj.max_staleness"
