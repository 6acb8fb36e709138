"""verl adapters: DataProto expansion, step-aware compute_advantage, agent-loop registration."""

import asyncio

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl import DataProto
from verl.trainer.ppo import ray_trainer
from verl.trainer.ppo.core_algos import get_adv_estimator_fn

from _stepwise_fixtures import make_batch, make_trajectory
from verl_traj.integration import stepwise_agent_loop as sal
from verl_traj.stepwise.advantages import StepwiseAdvantageError, compute_trajectory_advantages


def _dataproto(seed=0, merge=False):
    rng = np.random.default_rng(seed)
    trajs = [make_trajectory(rng, 3), make_trajectory(rng, 2), make_trajectory(rng, 4), make_trajectory(rng, 1)]
    tensors, non = make_batch(trajs, ["g0", "g0", "g1", "g1"], [1.0, 0.0, 0.3, 0.9])
    return DataProto.from_dict(tensors=tensors, non_tensors=non, meta_info={"k": 1}), trajs


@pytest.mark.parametrize("merge", [False, True])
def test_expand_dataproto_in_place(merge):
    data, trajs = _dataproto()
    metrics = sal.expand_dataproto_step_rows(data, merge_prefix=merge)
    n_steps = sum(len(t[0]) for t in trajs)
    assert len(data) == (4 if merge else n_steps)
    assert metrics["traj_stepwise/rows_before"] == n_steps
    assert metrics["traj_stepwise/rows_after"] == len(data)
    assert data.meta_info == {"k": 1}
    assert set(data.non_tensor_batch) >= {"uid", "traj_id", "step_index", "is_last_step", "data_source"}
    assert data.batch["input_ids"].shape[0] == len(data)
    # second call is a no-op (already expanded)
    assert sal.expand_dataproto_step_rows(data) == {} and len(data) == (4 if merge else n_steps)
    # the core layout accepts the expanded batch
    from verl_traj.core.layout import build_layout

    layout = build_layout(
        data.batch["attention_mask"], data.batch["response_mask"], data.non_tensor_batch["uid"],
        data.non_tensor_batch["traj_id"], data.non_tensor_batch["step_index"], data.non_tensor_batch["is_last_step"],
    )
    assert layout.num_trajectories == 4 and layout.num_groups == 2


@pytest.mark.parametrize("name", ["grpo", "rloo", "grpo_vectorized", "opo"])
def test_compute_stepwise_advantage_matches_pure_function(name):
    data, _ = _dataproto(1)
    sal.expand_dataproto_step_rows(data)
    data.batch["token_level_rewards"] = data.batch["rm_scores"].clone()
    out = sal.compute_stepwise_advantage(data, name, norm_adv_by_std_in_grpo=True, config=OmegaConf.create({}))
    nt = data.non_tensor_batch
    ref, *_ = compute_trajectory_advantages(
        data.batch["rm_scores"], data.batch["response_mask"], nt["uid"], nt["traj_id"], nt["is_last_step"],
        estimator_fn=get_adv_estimator_fn(name), estimator_name=name,
    )
    assert torch.allclose(out.batch["advantages"], ref)
    assert torch.count_nonzero(out.batch["advantages"][~torch.as_tensor(nt["is_last_step"])]) > 0  # earlier steps too


def test_compute_stepwise_advantage_rejects_temporal_and_falls_back_for_plain_batches():
    data, _ = _dataproto(2)
    sal.expand_dataproto_step_rows(data)
    data.batch["token_level_rewards"] = data.batch["rm_scores"].clone()
    with pytest.raises(StepwiseAdvantageError, match="gae"):
        sal.compute_stepwise_advantage(data, "gae", config=OmegaConf.create({}))
    plain, _ = _dataproto(2)
    plain.batch["token_level_rewards"] = plain.batch["rm_scores"].clone()
    ref = ray_trainer.compute_advantage(plain, "grpo", config=OmegaConf.create({}))
    plain2, _ = _dataproto(2)
    plain2.batch["token_level_rewards"] = plain2.batch["rm_scores"].clone()
    got = sal.compute_stepwise_advantage(plain2, "grpo", config=OmegaConf.create({}))
    assert torch.allclose(got.batch["advantages"], ref.batch["advantages"])


def test_kl_in_reward_uses_sum_over_steps():
    data, _ = _dataproto(3)
    sal.expand_dataproto_step_rows(data)
    tlr = data.batch["rm_scores"].clone() - 0.01 * data.batch["response_mask"].float()  # KL penalty on every row
    data.batch["token_level_rewards"] = tlr
    out = sal.compute_stepwise_advantage(data, "rloo", config=OmegaConf.create({"use_kl_in_reward": True}))
    nt = data.non_tensor_batch
    ref, *_ = compute_trajectory_advantages(
        tlr, data.batch["response_mask"], nt["uid"], nt["traj_id"], nt["is_last_step"],
        estimator_fn=get_adv_estimator_fn("rloo"), estimator_name="rloo", reward_reduction="sum",
    )
    assert torch.allclose(out.batch["advantages"], ref)


def test_padding_rows_from_the_planner_get_zero_advantage():
    data, _ = _dataproto(4)
    sal.expand_dataproto_step_rows(data)
    n = len(data)
    data.non_tensor_batch["is_padding"] = np.array([False] * (n - 1) + [True])
    data.non_tensor_batch["uid"][-1] = "__verl_traj_pad__0"
    data.non_tensor_batch["traj_id"][-1] = None
    data.batch["token_level_rewards"] = data.batch["rm_scores"].clone()
    data.batch["response_mask"][-1] = 0
    # the real trajectory that lost its last row would be invalid: make the pad row a copy of nothing
    data.non_tensor_batch["is_last_step"][-2] = True
    out = sal.compute_stepwise_advantage(data, "grpo", config=OmegaConf.create({}))
    assert torch.count_nonzero(out.batch["advantages"][-1]) == 0


def test_install_compute_advantage_is_idempotent_and_reversible():
    orig = ray_trainer.compute_advantage
    try:
        sal.install_compute_advantage()
        sal.install_compute_advantage()
        assert ray_trainer.compute_advantage is sal.compute_stepwise_advantage
        assert ray_trainer._verl_traj_original_compute_advantage is orig
        plain, _ = _dataproto(5)
        plain.batch["token_level_rewards"] = plain.batch["rm_scores"].clone()
        sal.compute_stepwise_advantage(plain, "grpo", config=OmegaConf.create({}))  # no recursion
    finally:
        ray_trainer.compute_advantage = orig
        if hasattr(ray_trainer, "_verl_traj_original_compute_advantage"):
            del ray_trainer._verl_traj_original_compute_advantage


def test_agent_loop_registered_and_importable_by_hydra_target():
    from hydra.utils import get_class
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    entry = _agent_loop_registry[sal.AGENT_LOOP_NAME]
    assert get_class(entry["_target_"]) is sal.StepwiseToolAgentLoop
    assert OmegaConf.create(sal.AGENT_LOOP_CONFIG_YAML)[0]["_target_"] == entry["_target_"]


def test_recording_server_manager_records_each_call():
    class Out:
        def __init__(self, ids, lps):
            self.token_ids, self.log_probs = ids, lps

    class Server:
        other = 42

        async def generate(self, request_id, *, prompt_ids, sampling_params, **kw):
            return Out([len(prompt_ids)], [-0.5])

    sink = []
    rec = sal.RecordingServerManager(Server(), sink)
    assert rec.other == 42

    async def go():
        await rec.generate("r", prompt_ids=[1, 2], sampling_params={})
        await rec.generate("r", prompt_ids=[1, 2, 2, 7], sampling_params={})

    asyncio.run(go())
    assert sink == [
        {"prompt_ids": [1, 2], "response_ids": [2], "response_logprobs": [-0.5]},
        {"prompt_ids": [1, 2, 2, 7], "response_ids": [4], "response_logprobs": [-0.5]},
    ]


@pytest.mark.parametrize("merge", [False, True])
def test_expand_plan_pad_then_advantages_end_to_end(merge):
    """The _balance_batch chain: expand -> core layout/plan/apply_plan (padding rows) -> step-aware advantages."""
    from verl_traj.core import apply_plan, build_layout, plan_mini_batches

    rng = np.random.default_rng(11)
    trajs = [make_trajectory(rng, int(rng.integers(1, 5))) for _ in range(8)]
    uids = [f"g{i // 2}" for i in range(8)]
    rewards = [float(x) for x in rng.random(8)]
    tensors, non = make_batch(trajs, uids, rewards)
    data = DataProto.from_dict(tensors=tensors, non_tensors=non)
    sal.expand_dataproto_step_rows(data, merge_prefix=merge)
    nt = data.non_tensor_batch
    # reference before planning
    ref_data = DataProto.from_dict(tensors={k: v.clone() for k, v in data.batch.items()},
                                   non_tensors={k: v.copy() for k, v in nt.items()})
    ref_data.batch["token_level_rewards"] = ref_data.batch["rm_scores"].clone()
    ref = sal.compute_stepwise_advantage(ref_data, "grpo", config=OmegaConf.create({})).batch["advantages"]

    layout = build_layout(data.batch["attention_mask"], data.batch["response_mask"], nt["uid"], nt["traj_id"],
                          nt["step_index"], nt["is_last_step"])
    plan = plan_mini_batches(layout, num_mini_batches=2, dp_size=3)
    t, n = apply_plan({k: v for k, v in data.batch.items()}, dict(nt), plan)
    planned = DataProto.from_dict(tensors=t, non_tensors=n)
    planned.batch["token_level_rewards"] = planned.batch["rm_scores"].clone()
    adv = sal.compute_stepwise_advantage(planned, "grpo", config=OmegaConf.create({})).batch["advantages"]
    pad = plan.is_padding
    assert int(pad.sum()) == int(plan.stats.padding_rows.sum())
    assert torch.count_nonzero(adv[pad]) == 0
    assert torch.allclose(adv[~pad], ref[plan.order[~pad]])


def test_context_manager_under_the_trainers_real_rows_wrapper():
    """Installed outside the trainer's real-rows wrapper: step batches use the step path, plain ones verl's."""
    orig = ray_trainer.compute_advantage

    def real_rows_wrapper(fn):  # stands in for the trainer's _compute_advantage_real_rows
        def w(data, *a, **k):
            return fn(data, *a, **k)

        w.__wrapped__ = fn
        return w

    with sal.stepwise_compute_advantage_installed():
        ray_trainer.compute_advantage = real_rows_wrapper(ray_trainer.compute_advantage)
        step, _ = _dataproto(6)
        sal.expand_dataproto_step_rows(step)
        step.batch["token_level_rewards"] = step.batch["rm_scores"].clone()
        ray_trainer.compute_advantage(step, "grpo", config=OmegaConf.create({}))
        assert torch.count_nonzero(step.batch["advantages"][~torch.as_tensor(step.non_tensor_batch["is_last_step"])]) > 0
        plain, _ = _dataproto(6)
        plain.batch["token_level_rewards"] = plain.batch["rm_scores"].clone()
        ray_trainer.compute_advantage(plain, "grpo", config=OmegaConf.create({}))  # no recursion
        assert "advantages" in plain.batch.keys()
    assert ray_trainer.compute_advantage is orig
    assert not hasattr(ray_trainer, "_verl_traj_original_compute_advantage")


def test_trainer_expands_before_planning_and_installs_advantage_in_fit():
    """TrajRayPPOTrainer with traj.step_wise: _balance_batch expands to step rows, then plans them
    (real planner, dp=2); fit runs with the step-aware compute_advantage, restored afterwards."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    import verl_traj.integration.trainer as T
    from verl_traj.config import TrajConfig

    def trainer(traj: TrajConfig):
        tr = T.TrajRayPPOTrainer.__new__(T.TrajRayPPOTrainer)
        tr.traj = traj
        tr.tokenizer = SimpleNamespace(pad_token_id=0)
        tr.global_steps = 1
        tr.config = OmegaConf.create({"data": {"train_batch_size": 2},
                                      "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 1}}})
        tr._dp_size = lambda: 2
        return tr

    data, trajs = _dataproto(7)
    n_steps = sum(len(t[0]) for t in trajs)
    metrics = {}
    trainer(TrajConfig(step_wise=True, merge_prefix=False))._balance_batch(data, metrics)
    assert metrics["traj_stepwise/rows_after"] == n_steps == metrics["traj_plan/real_rows"]
    assert metrics["traj_plan/split_trajectories"] == 0 and metrics["traj_plan/split_groups"] == 0
    real = ~data.batch["is_padding"]
    assert int(real.sum()) == n_steps and len(data) % 2 == 0
    assert {"traj_id", "step_index", "is_last_step"} <= set(data.non_tensor_batch)

    seen = {}
    original_fit = RayPPOTrainer.fit
    RayPPOTrainer.fit = lambda self: seen.setdefault("compute_advantage", ray_trainer.compute_advantage)
    try:
        trainer(TrajConfig(step_wise=True)).fit()
    finally:
        RayPPOTrainer.fit = original_fit
    # during fit: the real-rows wrapper around the step-aware function (installed outermost)
    assert seen["compute_advantage"].__wrapped__ is sal.compute_stepwise_advantage
    assert ray_trainer.compute_advantage is not sal.compute_stepwise_advantage  # restored after fit

