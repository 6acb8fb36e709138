"""TrajRayPPOTrainer pieces that need no Ray: planning in place, GRPO with padding rows, the fit-time
patches (and their restoration), real-row views, config preparation, loss fallbacks, worker helpers."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import numpy as np
import warnings

import pytest
import torch
from omegaconf import OmegaConf

from verl.trainer.ppo import ray_trainer as rt

from tests.integration import grad_harness as H
from verl_traj.core.trees.tree_cost import tree_cost_model
from verl_traj.config import TrajConfig, TrajConfigError
from verl_traj.core.plan.estimators import estimator_traits
from verl_traj.core.keys import planned_update_fields
from verl_traj.integration.config.verl_config import PlanSettings, prepare_config
from verl_traj.integration.patches.scoped import METRIC_FUNCTIONS, fit_patches, patched
from verl_traj.integration.rows import real_rows as R
from verl_traj.integration.trainers.update_contract import ACTOR
from verl_traj.testing import as_dataproto, rl_batch

from tests.integration.trainers import P, R_, fake_trainer


def make_batch(n_groups=5, n=3, seed=0, step_wise=False):
    return as_dataproto(*rl_batch(n_groups, n, prompt_len=P, response_len=R_, seed=seed,
                                  steps_per_traj=2 if step_wise else 0))


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
    for key in ("is_padding", "mini_batch_id", "micro_batch_id", "traj_index"):
        assert key in batch.batch.keys() and key not in batch.non_tensor_batch
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
    # the dense trajectory index travels with the rows (-1 on padding), one id per trajectory
    ti = batch.batch["traj_index"]
    assert ti[pad].eq(-1).all() and ti[~pad].min() == 0
    ids = batch.non_tensor_batch["traj_id"] if step_wise else np.arange(len(batch)).astype(str)
    pairs = {(int(t), str(i)) for t, i, p in zip(ti.tolist(), ids, pad.tolist()) if not p}
    assert len({t for t, _ in pairs}) == len(pairs) == len({i for _, i in pairs})
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
    get zero advantages and real rows get exactly what they get without any padding row; the real-rows
    wrapper (any estimator) agrees."""
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
    out_wrapped = R.advantage_on_real_rows(rt.compute_advantage)(_padded_batch(), **kw)
    torch.testing.assert_close(out_wrapped.batch["advantages"], out_all.batch["advantages"])


ALL_ESTIMATORS = ("gae", "gpg", "grpo", "opo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "rloo",
                  "rloo_vectorized", "optimal_token_baseline", "tir_optimal_token_baseline")


@pytest.mark.parametrize("name", ALL_ESTIMATORS)
def test_every_estimator_sees_real_rows_only(name):
    """The wrapper's result on a padded batch equals the estimator on the real rows alone, for every verl
    estimator; the whole-batch shortcut (no copy) is taken exactly for the padding-safe ones, and a
    regression there (verl changing an estimator) fails here."""
    def batch():
        b = _padded_batch()
        g = torch.Generator().manual_seed(5)
        b.batch["reward_baselines"] = torch.rand(len(b), generator=g)
        b.batch["sum_pi_squared"] = torch.rand(b.batch["old_log_probs"].shape, generator=g)
        return b

    kw = dict(adv_estimator=name, num_repeat=3, config=OmegaConf.create({"gamma": 1.0, "lam": 1.0}))
    data = batch()
    pad = data.batch["is_padding"]
    expected = rt.compute_advantage(data.select_idxs(~pad), **kw).batch["advantages"]
    got = R.advantage_on_real_rows(rt.compute_advantage)(batch(), **kw).batch["advantages"]
    torch.testing.assert_close(got[~pad], expected, atol=1e-6, rtol=1e-5)
    assert torch.all(got[pad] == 0)
    whole = rt.compute_advantage(batch(), **kw).batch["advantages"]
    safe = torch.allclose(whole[~pad], expected, atol=1e-6, rtol=1e-5) and bool(torch.isfinite(whole).all())
    assert estimator_traits(name).padding_safe <= safe  # the shortcut list holds only really safe estimators


def _patched_names():
    return ("compute_advantage", "apply_kl_penalty", "extract_reward", "compute_spec_decode_metrics") + METRIC_FUNCTIONS


@pytest.mark.parametrize("step_wise", [False, True])
def test_fit_patches_only_inside_fit_and_restored(step_wise):
    originals = {name: getattr(rt, name) for name in _patched_names()}
    with patched(fit_patches(step_wise)):
        for name in _patched_names():
            assert getattr(rt, name) is not originals[name]
        inner = rt.compute_advantage.__wrapped__  # real rows wrap the step-wise adapter (or verl's)
        assert (inner is not originals["compute_advantage"]) == step_wise
        assert (getattr(inner, "__wrapped__", None) is originals["compute_advantage"]) == step_wise
    assert {name: getattr(rt, name) for name in _patched_names()} == originals
    with pytest.raises(RuntimeError):
        with patched(fit_patches(step_wise)):
            raise RuntimeError("boom")
    assert {name: getattr(rt, name) for name in _patched_names()} == originals
    assert not [a for a in vars(rt) if "verl_traj" in a]  # nothing left on verl's module


def test_data_metrics_exclude_padding_and_share_one_copy():
    from verl.trainer.ppo.core_algos import AdvantageEstimator

    batch = _padded_batch()
    batch = rt.compute_advantage(batch, adv_estimator=AdvantageEstimator.GRPO, num_repeat=3,
                                 config=OmegaConf.create({}))
    pad = batch.batch["is_padding"]
    with patched(fit_patches(False)):
        m = rt.compute_data_metrics(batch=batch, use_critic=False)
        tp = rt.compute_throughout_metrics(batch=batch, timing_raw={"step": 1.0}, n_gpus=1)
    m_real = rt.compute_data_metrics(batch=batch.select_idxs(~pad), use_critic=False)
    m_all = rt.compute_data_metrics(batch=batch, use_critic=False)
    assert m["response_length/mean"] == pytest.approx(m_real["response_length/mean"])
    assert m["response_length/mean"] != pytest.approx(m_all["response_length/mean"])
    assert m["critic/score/mean"] == pytest.approx(m_real["critic/score/mean"])
    assert tp["perf/total_num_tokens"] == int(batch.batch["attention_mask"][~pad].sum())
    assert len(batch.meta_info["global_token_num"]) == len(batch)  # the full batch's meta_info untouched
    seen = []
    view = R.shared_view()
    f1 = R.metrics_on_real_rows(lambda b: seen.append(b), view)
    f2 = R.metrics_on_real_rows(lambda b: seen.append(b), view)
    f1(batch), f2(batch)
    assert seen[0] is seen[1] and len(seen[0]) == int((~pad).sum())  # one copy for both
    batch.batch["extra"] = torch.zeros(len(batch))
    f2(batch)
    assert seen[2] is not seen[0]  # the batch changed: a fresh view


def test_kl_in_reward_from_real_rows():
    from verl.trainer.ppo.core_algos import FixedKLController

    batch = _padded_batch()
    pad = batch.batch["is_padding"]
    real = batch.select_idxs(~pad)
    real.meta_info = dict(real.meta_info)
    _, m_real = rt.apply_kl_penalty(real, FixedKLController(0.1), "kl")
    out, m = R.kl_penalty_on_real_rows(rt.apply_kl_penalty)(batch, FixedKLController(0.1), "kl")
    assert m["actor/reward_kl_penalty"] == pytest.approx(m_real["actor/reward_kl_penalty"])
    assert torch.all(out.batch["token_level_rewards"][pad] == 0)


def test_loss_weights_through_trainer():
    batch = make_batch(step_wise=True)
    tr = fake_trainer({"group_by": "group", "loss_agg_mode": "traj-mean"})
    tr.plan_and_apply(batch, dp_size=2)
    with tr._planned_update(batch, ACTOR):
        w = batch.batch["loss_weight"]
    assert "loss_weight" not in batch.batch.keys()  # attached for the update call only
    pad = batch.batch["is_padding"]
    assert torch.all(w[pad] == 0)
    tok = batch.batch["response_mask"].sum(-1).double()
    for m in (0, 1):
        sel = (batch.batch["mini_batch_id"] == m) & ~pad
        assert float((w[sel].double() * tok[sel]).sum()) == pytest.approx(1.0, rel=1e-6)


def test_v0_carries_the_plans_atomic_fact_to_gspos_ratio_in_loss():
    """v0's plan travels in the batch: ``plan_and_apply`` records whether every trajectory sits in one micro-batch
    (``PLAN_ATOMIC``), and the actor's update contract reads it back for GSPO's ratio (``RATIO_IN_LOSS``) -- no
    state on the trainer between the two calls."""
    from verl_traj.core.keys import PLAN_ATOMIC, RATIO_GROUP, RATIO_IN_LOSS

    batch = make_batch(step_wise=True)
    tr = fake_trainer({"group_by": "group"})
    plan = tr.plan_and_apply(batch, dp_size=2)
    assert batch.meta_info[PLAN_ATOMIC] is plan.all_trajectories_atomic
    tr.spec = dataclasses.replace(tr.spec, ratio_groups=True)  # GSPO at trajectory scope on step rows
    for atomic in (False, True):
        batch.meta_info[PLAN_ATOMIC] = atomic
        with tr._planned_update(batch, ACTOR):
            assert RATIO_GROUP in batch.batch.keys()
            assert batch.meta_info.get(RATIO_IN_LOSS, False) is atomic
        assert RATIO_IN_LOSS not in batch.meta_info and RATIO_GROUP not in batch.batch.keys()


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


@pytest.mark.parametrize("rmpad, padded_cap, cost", [
    (False, "tokens", "padded"), (False, "area", "padded_area"), (True, "area", "tokens"), (True, "tokens", "tokens"),
])
def test_the_packing_cost_follows_the_attention_path_and_padded_cap(rmpad, padded_cap, cost):
    cfg = _verl_config(**{"actor_rollout_ref.model.use_remove_padding": rmpad})
    with pytest.warns(UserWarning, match="balance_batch"):
        micro = prepare_config(cfg, TrajConfig(micro_batch_max_tokens=100, padded_cap=padded_cap))
    assert micro.cost == cost


GPU_TREE_COST = tree_cost_model("cuda")  # verl's trainer.device default: the device's tree cost model


def test_prepare_config_forces_planner_and_sets_only_training_caps():
    cfg = _verl_config()
    with pytest.warns(UserWarning, match="balance_batch"):
        micro = prepare_config(cfg, TrajConfig(micro_batch_max_tokens=100))
    assert cfg.trainer.balance_batch is True
    assert micro == PlanSettings(100, "padded", derived=False, tree_cost=GPU_TREE_COST)  # no use_remove_padding: least padded area
    a, r, ref = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.ref
    assert a.use_dynamic_bsz and a.ppo_max_token_len_per_gpu == 100
    # inference passes keep verl's own bound (fixed sizes -> dynamic with the same memory bound)
    assert r.log_prob_use_dynamic_bsz and r.log_prob_max_token_len_per_gpu == 4 * 80
    assert ref.log_prob_use_dynamic_bsz and ref.log_prob_max_token_len_per_gpu == 4 * 80


def test_prepare_config_inference_cap_and_critic():
    cfg = _verl_config(**{"critic.enable": True, "critic.ppo_max_token_len_per_gpu": 200,
                          "actor_rollout_ref.model.use_remove_padding": True,
                          "critic.model.use_remove_padding": True})
    micro = prepare_config(cfg, TrajConfig(infer_micro_batch_max_tokens=500))
    assert cfg.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu == 500
    assert cfg.critic.ppo_infer_max_token_len_per_gpu == 500  # what verl 0.9.1 reads for the value pass
    # the update cap: the smaller of actor (fixed 2 x 80 -> 160) and critic, token cost with remove-padding
    assert micro == PlanSettings(160, "tokens", derived=True, tree_cost=GPU_TREE_COST)


@pytest.mark.parametrize("enable, estimator", [(None, "gae"), (None, "grpo"), (True, "grpo"), (False, "gae")])
def test_critic_is_on_exactly_when_verl_says_so(enable, estimator):
    """Regression: verl's critic.enable defaults to null and need_critic turns the critic on for gae; verl_traj read
    ``critic.enable`` as false there, left the critic's fixed micro-batches in place and skipped its checks."""
    from verl.trainer.ppo.utils import need_critic

    from verl_traj.integration.config.access import uses_critic

    cfg = _verl_config(**{"algorithm.adv_estimator": estimator, "critic.enable": enable,
                          "critic.ppo_max_token_len_per_gpu": 200})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = need_critic(cfg)
        prepare_config(cfg, TrajConfig())
    assert uses_critic(cfg) == expected
    assert bool(cfg.critic.use_dynamic_bsz) == expected  # the critic's fixed micro-batches became dynamic iff on


def _checked_and_prepared(cfg, traj_config):
    """Production's order: the start-up checks (``check_startup`` runs ``validate_against_verl``), then the trainer's
    ``prepare_config``."""
    from verl_traj.integration.startup.verl_checks import validate_against_verl

    validate_against_verl(traj_config, cfg)
    return prepare_config(cfg, traj_config)


def test_prepare_config_ulysses_cap_is_per_sequence_parallel_group():
    cfg = _verl_config(**{"actor_rollout_ref.actor.ulysses_sequence_parallel_size": 4})
    assert _checked_and_prepared(cfg, TrajConfig(micro_batch_max_tokens=30)).max_tokens == 120  # 30 x 4 >= 80
    with pytest.raises(TrajConfigError, match="ulysses_sequence_parallel_size=4.*at least 20"):
        _checked_and_prepared(_verl_config(**{"actor_rollout_ref.actor.ulysses_sequence_parallel_size": 4}),
                              TrajConfig(micro_batch_max_tokens=10))


def test_prepare_config_fixed_micro_batches_become_dynamic_with_same_bound():
    cfg = _verl_config(**{"trainer.balance_batch": True})
    micro = prepare_config(cfg, TrajConfig())
    a, r = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert a.use_dynamic_bsz and a.ppo_max_token_len_per_gpu == 2 * 80
    assert r.log_prob_use_dynamic_bsz and r.log_prob_max_token_len_per_gpu == 4 * 80
    assert micro == PlanSettings(160, "padded", derived=True, tree_cost=GPU_TREE_COST)


def test_prepare_config_errors_name_the_fix():
    with pytest.raises(TrajConfigError, match="loss_mode"):
        _checked_and_prepared(_verl_config(**{"actor_rollout_ref.actor.policy_loss.loss_mode": "sapo"}), TrajConfig())
    with pytest.raises(TrajConfigError, match="multiple of"):
        _checked_and_prepared(_verl_config(**{"data.train_batch_size": 6}), TrajConfig())
    with pytest.raises(TrajConfigError, match="micro_batch_max_tokens"):
        _checked_and_prepared(_verl_config(), TrajConfig(micro_batch_max_tokens=10))
    with pytest.raises(TrajConfigError, match="critic.ppo_mini_batch_size=3"):
        _checked_and_prepared(_verl_config(**{"critic.enable": True, "critic.ppo_mini_batch_size": 3}), TrajConfig())
    _checked_and_prepared(_verl_config(**{"critic.enable": True, "critic.ppo_mini_batch_size": 8}), TrajConfig())  # union


def test_losses_refuse_a_micro_batch_without_loss_weight(monkeypatch):
    """verl_traj's losses never fall back to verl's aggregation: a micro-batch without the trainer's ``loss_weight``
    (an update that was not planned, or whose weights did not reach the worker) is refused, naming the field."""
    from verl_traj.core.errors import TrajInputError
    from verl_traj.integration.workers.losses import traj_ppo_loss, traj_value_loss

    H.patch_verl_device(monkeypatch)
    rows = H.make_rows(6, 0, seed=3)
    for kind, ours, cfg in (("policy", traj_ppo_loss, H.actor_config()), ("value", traj_value_loss, H.critic_config())):
        with pytest.raises(TrajInputError, match="without 'loss_weight'"):
            H.engine_step(H.TinyLM(), rows, kind, ours, cfg, max_token_len=10**6, dp_size=1)


def test_worker_iterator_steps_the_plan_in_the_same_order_on_every_rank():
    from tensordict import TensorDict

    from verl_traj.integration.workers.engine_workers import PlannedUpdate, mini_batch_slices

    assert mini_batch_slices(torch.tensor([0, 0, 1, 2, 2, 2])) == [(0, 2), (2, 3), (3, 6)]
    assert mini_batch_slices(torch.tensor([0, 0, 1, 2, 3, 3]), union=2) == [(0, 3), (3, 6)]
    with pytest.raises(RuntimeError, match="expected 0, 1, 2"):
        mini_batch_slices(torch.tensor([0, 1, 0]))
    ranks = []
    for rank_rows in ([0, 0, 1, 2, 2], [0, 1, 1, 1, 2]):  # two ranks: different sizes, same mini-batches
        td = TensorDict({"mini_batch_id": torch.tensor(rank_rows), "row": torch.arange(5)}, batch_size=[5])
        run = PlannedUpdate(seed=7, fields=planned_update_fields())
        it = run.make_iterator(None)(td, mini_batch_size=1, epochs=3, seed=7 + len(ranks), dataloader_kwargs={"shuffle": True})
        ranks.append([int(mb["mini_batch_id"][0]) for mb in it])
        assert run.steps == 9
    assert ranks[0] == ranks[1] and len(set(map(tuple, np.array(ranks[0]).reshape(3, 3)))) > 1


def test_worker_micro_batches_are_the_plan():
    from tensordict import TensorDict

    from verl_traj.core.errors import TrajInputError
    from verl_traj.integration.workers.engine_workers import PlannedUpdate

    td = TensorDict({"mini_batch_id": torch.tensor([0, 0, 0, 1, 1]), "micro_batch_id": torch.tensor([1, 0, 1, 0, 0]),
                     "row": torch.arange(5)}, batch_size=[5])
    run = PlannedUpdate(seed=0, fields=planned_update_fields())
    micro, idx = run.prepare_micro_batches(lambda *a, **k: pytest.fail("verl's cut must not run"))(td)
    assert idx == [[1], [0, 2], [3, 4]] and [m["row"].tolist() for m in micro] == idx
    assert run.micro_batches_run == [3]
    with pytest.raises(TrajInputError, match="micro_batch_id"):  # never verl's cut inside a planned update
        run.prepare_micro_batches(lambda data, **k: ("verl", data))(TensorDict({}, batch_size=[2]))


def test_traj_disabled_is_stock(monkeypatch):
    """traj.enable=false: verl's own _balance_batch runs and nothing is changed; verl_traj only observes what
    stock mini-batches do to groups (``stock_plan/*`` metrics)."""
    tr = fake_trainer({"enable": False}, dp=2, n=3)
    calls, metrics = [], {}
    batch = make_batch(n_groups=4)
    before = batch.batch["input_ids"].clone()
    monkeypatch.setattr(rt.RayPPOTrainer, "_balance_batch", lambda self, *a, **k: calls.append("balance"))
    tr._balance_batch(batch, metrics)
    assert calls == ["balance"] and torch.equal(batch.batch["input_ids"], before)
    assert not any(k.startswith("traj_plan/") for k in metrics)
    # 12 rows, 2 ranks, mini-batches of 2 x 3 rows: rank blocks [0..5], [6..11] cut in 3-row slices -> groups of 3
    # consecutive rows fall into one slice each here, so nothing is split
    assert metrics["stock_plan/split_groups"] == 0 and metrics["stock_plan/num_mini_batches"] == 2


@pytest.mark.parametrize("tp, cp, measured_minimum", [(1, 2, 2), (2, 2, 3), (2, 4, 8), (4, 4, 16), (8, 1, None)])
def test_padding_rows_are_long_enough_for_context_parallel_packing(tp, cp, measured_minimum):
    """verl PR 7449 measured the shortest padding rows that survive THD context-parallel packing: 2 / 3 / 8 / 16
    tokens at TP1CP2 / TP2CP2 / TP2CP4 / TP4CP4. The derived length covers each; without CP rows stay at 2;
    the planned padding rows really have that many attended tokens."""
    from verl_traj.integration.config.verl_config import pad_row_tokens

    cfg = OmegaConf.create({"actor_rollout_ref": {"actor": {"strategy": "megatron", "megatron": {
        "tensor_model_parallel_size": tp, "context_parallel_size": cp}}}})
    n = pad_row_tokens(cfg)
    assert n == (tp * cp if cp > 1 else 2)
    assert measured_minimum is None or n >= measured_minimum
    assert pad_row_tokens(OmegaConf.create({"actor_rollout_ref": {"actor": {"strategy": "fsdp2"}}})) == 2
    batch = make_batch(n_groups=5, n=3, seed=1)
    tr = fake_trainer()
    tr.spec = dataclasses.replace(tr.spec, plan=PlanSettings(10_000, "tokens", True, pad_row_tokens=n))
    tr.plan_and_apply(batch, dp_size=4)
    pad = batch.batch["is_padding"]
    assert pad.any() and batch.batch["attention_mask"][pad].sum(-1).eq(min(n, P + R_ - P + 1)).all()
    assert batch.batch["response_mask"][pad].sum() == 0


def test_an_actor_loss_that_is_not_verls_partial_is_refused_not_kept():
    """verl_traj swaps verl's ``partial(ppo_loss, config=...)`` for ``traj_ppo_loss`` with the same config; a worker
    class that builds its loss otherwise would keep verl's loss, which ignores the planned loss weights: refused."""
    from functools import partial

    from verl.workers.utils.losses import ppo_loss

    from verl_traj.core.errors import TrajInputError
    from verl_traj.integration.workers.losses import traj_ppo_loss
    from verl_traj.integration.workers.engine_workers import TrajActorMixin

    class Actor:
        def set_loss_fn(self, fn):
            self.fn = fn

    def verl_like(loss_fn):
        class Base:  # what verl's ActorRolloutRefWorker.init_model leaves behind
            def init_model(self):
                self.actor, self.distillation_enabled, self.loss_fn = Actor(), False, loss_fn

        return type("Worker", (TrajActorMixin, Base), {})()

    worker = verl_like(partial(ppo_loss, config="cfg"))
    worker.init_model()
    assert worker.loss_fn.func is traj_ppo_loss and worker.actor.fn.keywords == {"config": "cfg"}
    with pytest.raises(TrajInputError, match="not verl's partial") as err:
        verl_like(lambda *a, **k: None).init_model()
    assert err.value.field == "loss_fn"
