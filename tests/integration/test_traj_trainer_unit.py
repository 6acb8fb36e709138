"""TrajRayPPOTrainer pieces that need no Ray: planning in place, GRPO with padding rows, fit-time
real-row wrappers (and their restoration), config preparation, loss fallbacks, worker helpers."""

from __future__ import annotations

import os
import sys
from collections import defaultdict

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl import DataProto
from verl.trainer.ppo import ray_trainer as rt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from verl_traj.config import TrajConfig, TrajConfigError  # noqa: E402
from verl_traj.integration import trainer as T  # noqa: E402

P, R = 5, 6


def make_batch(n_groups=5, n=3, seed=0, step_wise=False) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    B = n_groups * n
    attn = torch.zeros(B, P + R, dtype=torch.long)
    resp_mask = torch.zeros(B, R, dtype=torch.long)
    for i in range(B):
        lp = int(torch.randint(1, P + 1, (1,), generator=g))
        lr = int(torch.randint(1, R + 1, (1,), generator=g))
        attn[i, P - lp: P + lr] = 1
        resp_mask[i, :lr] = 1
    input_ids = torch.randint(1, 50, (B, P + R), generator=g) * attn
    scores = torch.zeros(B, R)
    for i in range(B):
        L = int(resp_mask[i].sum())
        scores[i, L - 1] = float(torch.rand(1, generator=g) > 0.5)
    tensors = {
        "input_ids": input_ids,
        "prompts": input_ids[:, :P],
        "responses": input_ids[:, P:],
        "attention_mask": attn,
        "position_ids": torch.clamp(torch.cumsum(attn, -1) - 1, min=0),
        "response_mask": resp_mask,
        "token_level_rewards": scores,
        "token_level_scores": scores.clone(),
        "old_log_probs": -torch.rand(B, R, generator=g),
        "ref_log_prob": -torch.rand(B, R, generator=g),
    }
    uid = np.array([f"u{i // n}" for i in range(B)], dtype=object)
    nt = {"uid": uid, "multi_modal_inputs": np.array([{} for _ in range(B)], dtype=object)}
    if step_wise:
        # trajectories of 1-2 step rows: row i belongs to trajectory i // 2 within its group
        nt["traj_id"] = np.array([f"{uid[i]}_t{(i % n) // 2}" for i in range(B)], dtype=object)
        steps, seen = [], defaultdict(int)
        for t in nt["traj_id"]:
            steps.append(seen[t])
            seen[t] += 1
        nt["step_index"] = np.array(steps, dtype=np.int64)
    return DataProto.from_dict(tensors=tensors, non_tensors=nt, meta_info={"global_token_num": attn.sum(-1).tolist()})


def fake_trainer(traj: dict | None = None, train_batch_size=4, mini=2, epochs=1):
    tr = T.TrajRayPPOTrainer.__new__(T.TrajRayPPOTrainer)
    tr.traj = TrajConfig.from_mapping(traj or {})
    tr.config = OmegaConf.create(
        {
            "data": {"train_batch_size": train_batch_size, "max_prompt_length": P, "max_response_length": R},
            "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": mini, "ppo_epochs": epochs,
                                            "loss_agg_mode": "token-mean"}},
        }
    )
    tr.tokenizer = None
    tr.global_steps = 1
    return tr


@pytest.mark.parametrize("group_by", ["group", "trajectory"])
@pytest.mark.parametrize("step_wise", [False, True])
def test_plan_and_apply_in_place(group_by, step_wise):
    batch = make_batch(step_wise=step_wise)
    before_rows = len(batch)
    tr = fake_trainer({"group_by": group_by})
    metrics = {}
    same = batch
    plan = tr.plan_and_apply(batch, dp_size=2, metrics=metrics)
    assert batch is same
    assert len(batch) == plan.num_rows >= before_rows
    assert len(batch) % 2 == 0
    assert "is_padding" in batch.batch.keys() and "is_padding" not in batch.non_tensor_batch
    pad = batch.batch["is_padding"]
    mb = batch.batch["mini_batch_id"]
    assert int((~pad).sum()) == before_rows
    assert sorted(mb.unique().tolist()) == [0, 1]  # 4 // 2 configured mini-batches
    if group_by == "group":  # (trajectory units without step rows are single rows: nothing to check)
        units = defaultdict(set)
        for u, m, p in zip(batch.non_tensor_batch["uid"], mb.tolist(), pad.tolist()):
            if not p:
                units[u].add(m)
        assert all(len(v) == 1 for v in units.values())
    if step_wise:
        trajs = defaultdict(set)
        for t, m, p in zip(batch.non_tensor_batch["traj_id"], mb.tolist(), pad.tolist()):
            if not p:
                trajs[t].add(m)
        assert all(len(v) == 1 for v in trajs.values())
    # padding rows: no loss token, unique uid, 2 attended tokens
    assert int(batch.batch["response_mask"][pad].sum()) == 0
    pad_uids = batch.non_tensor_batch["uid"][pad.numpy()]
    assert len(set(pad_uids)) == len(pad_uids)
    assert all(int(x) == 2 for x in batch.batch["attention_mask"][pad].sum(-1))
    # plan metrics logged
    assert metrics["traj_plan/num_mini_batches"] == 2
    assert metrics["traj_plan/split_trajectories"] == 0
    if group_by == "group":
        assert metrics["traj_plan/split_groups"] == 0
    assert metrics["traj_plan/padding_rows"] == float(pad.sum())
    assert metrics["traj_plan/expected_optimizer_steps"] == 2
    # verl can still convert it (no tensor/non-tensor key clash)
    batch.to_tensordict()


def _padded_batch(seed=0):
    batch = make_batch(n_groups=5, n=3, seed=seed)
    fake_trainer().plan_and_apply(batch, dp_size=4)
    assert bool(batch.batch["is_padding"].any())
    # as in fit: computed after _balance_batch, so it counts padding rows too
    batch.meta_info["global_token_num"] = batch.batch["attention_mask"].sum(-1).tolist()
    return batch


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_padding_rows_never_touch_group_statistics(norm):
    """verl's own compute_advantage on a planned batch: padding rows (unique uid, zero response_mask)
    get zero advantages and real rows get exactly what they get without any padding row."""
    from verl.trainer.ppo.core_algos import AdvantageEstimator

    batch = _padded_batch()
    pad = batch.batch["is_padding"]
    real = batch.select_idxs(~pad)
    kw = dict(adv_estimator=AdvantageEstimator.GRPO, num_repeat=3, norm_adv_by_std_in_grpo=norm,
              config=OmegaConf.create({}))
    out_all = rt.compute_advantage(batch, **kw)
    out_real = rt.compute_advantage(real, **kw)
    assert torch.all(out_all.batch["advantages"][pad] == 0)
    torch.testing.assert_close(out_all.batch["advantages"][~pad], out_real.batch["advantages"])
    # our fit-time wrapper (real rows only, any estimator) agrees
    batch2 = _padded_batch()
    out_wrapped = T._compute_advantage_real_rows(rt.compute_advantage.__wrapped__
                                                 if hasattr(rt.compute_advantage, "__wrapped__")
                                                 else rt.compute_advantage)(batch2, **kw)
    torch.testing.assert_close(out_wrapped.batch["advantages"], out_all.batch["advantages"])


def test_fit_globals_swapped_only_inside_and_restored():
    originals = {name: getattr(rt, name) for name in T.FIT_WRAPPERS}
    with T.fit_globals_on_real_rows():
        for name in T.FIT_WRAPPERS:
            assert getattr(rt, name) is not originals[name]
            assert getattr(rt, name).__wrapped__ is originals[name]
    assert {name: getattr(rt, name) for name in T.FIT_WRAPPERS} == originals
    with pytest.raises(RuntimeError):
        with T.fit_globals_on_real_rows():
            raise RuntimeError("boom")
    assert {name: getattr(rt, name) for name in T.FIT_WRAPPERS} == originals


def test_data_metrics_exclude_padding():
    from verl.trainer.ppo.core_algos import AdvantageEstimator

    batch = _padded_batch()
    batch = rt.compute_advantage(batch, adv_estimator=AdvantageEstimator.GRPO, num_repeat=3,
                                 config=OmegaConf.create({}))
    pad = batch.batch["is_padding"]
    with T.fit_globals_on_real_rows():
        m = rt.compute_data_metrics(batch=batch, use_critic=False)
        tp = rt.compute_throughout_metrics(batch=batch, timing_raw={"step": 1.0}, n_gpus=1)
    ref = rt.compute_data_metrics.__wrapped__ if hasattr(rt.compute_data_metrics, "__wrapped__") else None
    assert ref is None  # restored
    m_real = rt.compute_data_metrics(batch=batch.select_idxs(~pad), use_critic=False)
    m_all = rt.compute_data_metrics(batch=batch, use_critic=False)
    assert m["response_length/mean"] == pytest.approx(m_real["response_length/mean"])
    assert m["response_length/mean"] != pytest.approx(m_all["response_length/mean"])
    assert m["critic/score/mean"] == pytest.approx(m_real["critic/score/mean"])
    real_tokens = int(batch.batch["attention_mask"][~pad].sum())
    assert tp["perf/total_num_tokens"] == real_tokens
    # the meta_info of the real batch was not modified
    assert len(batch.meta_info["global_token_num"]) == len(batch)


def test_kl_in_reward_from_real_rows():
    from verl.trainer.ppo.core_algos import FixedKLController

    batch = _padded_batch()
    pad = batch.batch["is_padding"]
    real = batch.select_idxs(~pad)
    real.meta_info = dict(real.meta_info)
    _, m_real = rt.apply_kl_penalty(real, FixedKLController(0.1), "kl")
    out, m = T._apply_kl_penalty_real_rows(rt.apply_kl_penalty)(batch, FixedKLController(0.1), "kl")
    assert m["actor/reward_kl_penalty"] == pytest.approx(m_real["actor/reward_kl_penalty"])
    assert torch.all(out.batch["token_level_rewards"][pad] == 0)


def test_loss_weights_through_trainer():
    batch = make_batch(step_wise=True)
    tr = fake_trainer({"group_by": "group"})
    tr.plan_and_apply(batch, dp_size=2)
    w = tr.loss_weights(batch, "traj-mean")
    pad = batch.batch["is_padding"]
    assert torch.all(w[pad] == 0)
    tok = batch.batch["response_mask"].sum(-1).double()
    for m in (0, 1):
        sel = (batch.batch["mini_batch_id"] == m) & ~pad
        assert float((w[sel].double() * tok[sel]).sum()) == pytest.approx(1.0, rel=1e-6)


def _verl_config(**over):
    cfg = OmegaConf.create(
        {
            "data": {"train_batch_size": 8, "max_prompt_length": 64, "max_response_length": 16},
            "algorithm": {"adv_estimator": "grpo"},
            "trainer": {"balance_batch": False, "use_v1": False},
            "actor_rollout_ref": {
                "actor": {"ppo_mini_batch_size": 4, "use_dynamic_bsz": False, "ppo_micro_batch_size_per_gpu": 2,
                          "ppo_max_token_len_per_gpu": 16384, "policy_loss": {"loss_mode": "vanilla"}},
                "rollout": {"log_prob_use_dynamic_bsz": False, "log_prob_micro_batch_size_per_gpu": 4,
                            "log_prob_max_token_len_per_gpu": 16384},
                "ref": {"log_prob_use_dynamic_bsz": False, "log_prob_micro_batch_size_per_gpu": 4,
                        "log_prob_max_token_len_per_gpu": 16384},
            },
            "critic": {"use_dynamic_bsz": False, "ppo_micro_batch_size_per_gpu": 2, "ppo_max_token_len_per_gpu": 1,
                       "forward_max_token_len_per_gpu": 1},
        }
    )
    for k, v in over.items():
        OmegaConf.update(cfg, k, v)
    return cfg


def test_prepare_config_forces_planner_and_token_cap():
    cfg = _verl_config()
    with pytest.warns(UserWarning, match="balance_batch"):
        T.prepare_config(cfg, TrajConfig(micro_batch_max_tokens=100))
    assert cfg.trainer.balance_batch is True
    a, r, ref, c = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.ref, cfg.critic
    assert a.use_dynamic_bsz and a.ppo_max_token_len_per_gpu == 100
    assert r.log_prob_use_dynamic_bsz and r.log_prob_max_token_len_per_gpu == 100
    assert ref.log_prob_use_dynamic_bsz and ref.log_prob_max_token_len_per_gpu == 100
    assert c.use_dynamic_bsz and c.ppo_max_token_len_per_gpu == 100 and c.forward_max_token_len_per_gpu == 100


def test_prepare_config_fixed_micro_batches_become_dynamic_with_same_bound():
    cfg = _verl_config(**{"trainer.balance_batch": True})
    T.prepare_config(cfg, TrajConfig())
    a, r = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert a.use_dynamic_bsz and a.ppo_max_token_len_per_gpu == 2 * 80
    assert r.log_prob_use_dynamic_bsz and r.log_prob_max_token_len_per_gpu == 4 * 80


def test_prepare_config_errors_name_the_fix():
    with pytest.raises(TrajConfigError, match="loss_mode"):
        T.prepare_config(_verl_config(**{"actor_rollout_ref.actor.policy_loss.loss_mode": "sapo"}), TrajConfig())
    with pytest.raises(TrajConfigError, match="multiple of"):
        T.prepare_config(_verl_config(**{"data.train_batch_size": 6}), TrajConfig())
    with pytest.raises(TrajConfigError, match="micro_batch_max_tokens"):
        T.prepare_config(_verl_config(), TrajConfig(micro_batch_max_tokens=10))


def test_losses_fall_back_to_verl_without_loss_weight():
    import _grad_harness as H
    from verl.workers.utils.losses import ppo_loss, value_loss

    from verl_traj.integration.losses import traj_ppo_loss, traj_value_loss

    H.patch_verl_device()
    rows = H.make_rows(6, 0, seed=3)
    for kind, ours, theirs, cfg in (("policy", traj_ppo_loss, ppo_loss, H.actor_config()),
                                    ("value", traj_value_loss, value_loss, H.critic_config())):
        grads = []
        for fn in (ours, theirs):
            model = H.TinyLM()
            H.engine_step(model, rows, kind, fn, cfg, max_token_len=10**6, dp_size=1)
            grads.append(H.flat_grad(model))
        torch.testing.assert_close(grads[0], grads[1])


def test_worker_mini_batch_split_and_order():
    from verl_traj.integration.workers import mini_batch_order, split_by_mini_batch_id

    split = split_by_mini_batch_id(torch.tensor([0, 0, 1, 2, 1, 2, 2]))
    assert {k: v.tolist() for k, v in split.items()} == {0: [0, 1], 1: [2, 4], 2: [3, 5, 6]}
    # same order on every rank (depends on seed and epoch only), a permutation, varies with epoch
    orders = [mini_batch_order(8, e, 42, True).tolist() for e in range(4)]
    assert all(sorted(o) == list(range(8)) for o in orders)
    assert orders == [mini_batch_order(8, e, 42, True).tolist() for e in range(4)]
    assert len({tuple(o) for o in orders}) > 1
    assert mini_batch_order(5, 3, 0, False).tolist() == list(range(5))


def test_traj_disabled_is_stock():
    """traj.enable=false: every overridden method is verl's."""
    tr = fake_trainer({"enable": False})
    calls = []
    orig = rt.RayPPOTrainer._balance_batch
    try:
        rt.RayPPOTrainer._balance_batch = lambda self, *a, **k: calls.append("balance")
        tr._balance_batch(make_batch(), {})
    finally:
        rt.RayPPOTrainer._balance_batch = orig
    assert calls == ["balance"]
    batch = make_batch()
    assert not tr._planned(batch)
