"""The v1 trainer adapter's pure parts (:mod:`verl_traj.integration.trainers.v1` and its ``v1_*`` modules): keys ->
layout, the planned advantage
(v1's reward-on-every-step-row convention gives exactly v0's step-wise advantages), padding rows with the source's
schema, the trainer classes every registered mode gets, and the start-up checks for ``trainer.use_v1=true``."""

from __future__ import annotations

import dataclasses
import zlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl.trainer.ppo import ray_trainer

from tests.stepwise.verl_batches import planned_stepwise_batch
from verl_traj.config import TrajConfig, TrajConfigError
from verl_traj.core import build_layout_from_counts, plan_mini_batches
from verl_traj.core.errors import TrajInputError
from verl_traj.core.keys import TURN_REWARDS
from verl_traj.core.rollout.row_key import parse_row_keys, row_key, row_key_order
from verl_traj.core.rollout.row_tags import turn_reward_tag, turn_reward_entries
from verl_traj.integration.rows.stepwise_rows import stepwise_advantage
from verl_traj.integration.startup.verl_checks import validate_against_verl
from verl_traj.integration.trainers import v1 as V1
from verl_traj.integration.trainers.v1_advantage import corrected_per_trajectory, planned_advantage
from verl_traj.integration.trainers.v1_metrics import last_rows_of_trajectories, stepwise_metrics
from verl_traj.integration.trainers.v1_padding import padding_row
from verl_traj.integration.trainers.v1_plan_facts import PlanFacts, plan_facts, row_loss_tokens
from verl_traj.testing import as_dataproto, rl_batch


def test_row_key_codec_reads_group_trajectory_and_step():
    keys = ["a_1_0_0", "a_1_0_1", "a_1_1_0", row_key("pad9", 0, 0), "a_1_10_0", "a_1_9_0"]
    parsed = parse_row_keys(keys)
    assert parsed.uid.tolist() == ["a_1"] * 3 + ["pad9"] + ["a_1"] * 2  # a uid may hold "_"
    assert parsed.traj_id.tolist() == ["a_1_0", "a_1_0", "a_1_1", "pad9_0", "a_1_10", "a_1_9"]
    assert parsed.step.tolist() == [0, 1, 0, 0, 0, 0]
    assert sorted(keys, key=row_key_order)[-3:-1] == ["a_1_9_0", "a_1_10_0"]  # sessions in numeric order
    for bad in ("plainkey", "a_x_0", "_0_0", "a_0_-1"):
        with pytest.raises(TrajInputError, match="row key=.*uid.*session.*index") as err:
            parse_row_keys(["a_0_0", bad])
        assert err.value.field == "row key"


def test_row_loss_tokens_dense_and_jagged_agree():
    rows = [torch.tensor([1, 0, 1, 1]), torch.tensor([0]), torch.tensor([1, 1])]
    nested = torch.nested.nested_tensor(rows, layout=torch.jagged)
    dense = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    assert row_loss_tokens(nested).tolist() == row_loss_tokens(dense).tolist() == [3, 0, 2]


def _v1_view(data):
    """The rows of a planned v0 step-wise batch as v1 stores them: keys ``{uid}_{traj}_{step}``, and the
    trajectory's reward copied onto every step row (v1's agent-loop worker does that)."""
    nt, td = data.non_tensor_batch, data.batch
    pad = td["is_padding"]
    keys = [row_key(f"pad{i}", 0, 0) if p else row_key(u, t, s) for i, (u, t, s, p) in
            enumerate(zip(nt["uid"], td["traj_index"].tolist(), nt["step_index"], pad.tolist()))]
    reward = torch.zeros(len(keys))
    last = torch.as_tensor(np.asarray(nt["is_last_step"], dtype=bool)) & ~pad
    for i in torch.nonzero(last).flatten().tolist():
        reward[td["traj_index"] == td["traj_index"][i]] = td["rm_scores"][i].sum()
    scores = torch.zeros_like(td["rm_scores"])
    ends = td["response_mask"].shape[1] - 1 - torch.argmax(td["attention_mask"][:, -scores.shape[1]:].flip(-1), -1)
    scores[torch.arange(len(keys)), ends] = reward * (~pad).float()
    turn = None  # the rows' turn rewards as the agent-loop worker tags them
    if TURN_REWARDS in td.keys():
        turn = turn_reward_entries([turn_reward_tag(r) for r in td[TURN_REWARDS]])
    facts = PlanFacts(tuple(keys), td["traj_index"].clone(), last, pad.clone(), td["mini_batch_id"].clone(),
                      row_loss_tokens(td["response_mask"]) * ~pad, multi_row=True, turn_rewards=turn)
    return keys, scores, facts


def _ignored(facts: PlanFacts) -> None:
    """``hand_on`` where a test reads only the advantages."""


@pytest.mark.parametrize("name", ["grpo", "rloo", "opo"])
@pytest.mark.parametrize("kl_in_reward", [False, True])
def test_planned_advantage_counts_the_copied_reward_once(name, kl_in_reward):
    """v0 (reward on the last step row only) and v1 (the same reward on every step row) give the same
    advantages, on each row's own tokens; padding rows get zeros; with KL-in-reward the per-step penalties are
    summed and the reward still counted once."""
    data, _ = planned_stepwise_batch(1, dp=2)
    penalty = 0.01 * data.batch["response_mask"].float() if kl_in_reward else 0.0
    data.batch["token_level_rewards"] = data.batch["rm_scores"] - penalty
    config = OmegaConf.create({"use_kl_in_reward": kl_in_reward})
    expected = stepwise_advantage(ray_trainer.compute_advantage)(data, name, config=config).batch["advantages"]

    keys, scores, facts = _v1_view(data)
    v1 = as_dataproto({"token_level_scores": scores, "token_level_rewards": scores - penalty,
                       "response_mask": data.batch["response_mask"], "attention_mask": data.batch["attention_mask"],
                       "responses": data.batch["responses"]}, {"uid": parse_row_keys(keys).uid})
    got = planned_advantage(facts, v1, keys, name, config=config, hand_on=_ignored).batch["advantages"]
    torch.testing.assert_close(got, expected)
    assert torch.count_nonzero(got[facts.is_padding]) == 0
    assert torch.all((got != 0) <= (data.batch["response_mask"] != 0))  # only on each row's own loss tokens


@pytest.mark.parametrize("name", ["grpo", "gae"])
@pytest.mark.parametrize("merge", [False, True])
def test_planned_advantage_puts_turn_rewards_where_v0_does(name, merge):
    """Turn rewards on v1: the rows' sparse tags (:data:`~verl_traj.core.rollout.row_tags.TURN_REWARD_TAG`),
    decoded by the plan's facts, give exactly v0's step-wise advantages (v0 carries the same rewards as a tensor from
    its expansion), for an outcome (GRPO) and a temporal (GAE) estimator, unmerged and merged, and change them."""
    torch.manual_seed(0)
    data, _ = planned_stepwise_batch(6, merge=merge, turn_rewards=True)
    data.batch["values"] = (data.batch["responses"].float() % 5) * 0.1
    config = OmegaConf.create({"gamma": 0.9})
    keys, scores, facts = _v1_view(data)
    tensors = {"token_level_scores": scores, "token_level_rewards": scores.clone(), "values": data.batch["values"],
               "response_mask": data.batch["response_mask"], "attention_mask": data.batch["attention_mask"]}
    # (no "responses": v1's advantage batch has none, regression of the first run with turn rewards)
    got = planned_advantage(facts, as_dataproto(tensors, {"uid": parse_row_keys(keys).uid}), keys, name,
                            gamma=0.9, lam=0.95, config=config, hand_on=_ignored).batch["advantages"]
    expected = stepwise_advantage(ray_trainer.compute_advantage)(data, name, gamma=0.9, lam=0.95, config=config)
    torch.testing.assert_close(got, expected.batch["advantages"])
    outcome_only = dataclasses.replace(facts, turn_rewards=None)
    tensors["token_level_rewards"] = scores.clone()
    without = planned_advantage(outcome_only, as_dataproto(tensors, {"uid": parse_row_keys(keys).uid}), keys, name,
                                gamma=0.9, lam=0.95, config=config, hand_on=_ignored).batch["advantages"]
    assert not torch.allclose(got, without, atol=1e-4)  # the tags are read, not dropped


def test_planned_advantage_on_one_row_trajectories_is_verl_on_real_rows():
    tensors, non = rl_batch(groups=3, n=4, seed=2)
    B = len(non["uid"])
    pad = torch.zeros(B + 2, dtype=torch.bool)
    pad[-2:] = True
    keys = [f"{u}_{i % 4}_0" for i, u in enumerate(non["uid"])] + ["pad0_0_0", "pad1_0_0"]
    grow = {k: torch.cat([v, torch.zeros((2,) + v.shape[1:], dtype=v.dtype)]) for k, v in tensors.items()}
    facts = PlanFacts(tuple(keys), torch.cat([torch.arange(B), torch.tensor([-1, -1])]), ~pad, pad,
                      torch.zeros(B + 2, dtype=torch.long), torch.zeros(B + 2, dtype=torch.long), multi_row=False)
    data = as_dataproto(grow, {"uid": parse_row_keys(keys).uid})
    got = planned_advantage(facts, data, keys, "grpo", num_repeat=4, config=OmegaConf.create({}), hand_on=_ignored)
    ref = ray_trainer.compute_advantage(as_dataproto(tensors, dict(non)), "grpo", num_repeat=4,
                                        config=OmegaConf.create({}))
    torch.testing.assert_close(got.batch["advantages"][:B], ref.batch["advantages"])
    assert torch.count_nonzero(got.batch["advantages"][B:]) == 0
    with pytest.raises(RuntimeError, match="not the ones _balance_batch planned"):  # the trainer's check
        facts.check(list(reversed(keys)))


def test_planned_advantage_records_each_rows_final_loss_tokens():
    """The loss weights read each row's loss-token count from the plan's facts: the advantage, which gets the mask
    after verl's rollout correction (here: every row's last response token rejected), recounts them; 0 on padding."""
    data, _ = planned_stepwise_batch(2)
    keys, scores, facts = _v1_view(data)
    mask = data.batch["response_mask"].clone()
    mask[:, -1] = 0
    v1 = as_dataproto({"token_level_scores": scores, "token_level_rewards": scores.clone(), "response_mask": mask,
                       "attention_mask": data.batch["attention_mask"]}, {"uid": parse_row_keys(keys).uid})
    handed = []
    planned_advantage(facts, v1, keys, "grpo", config=OmegaConf.create({}), hand_on=handed.append)
    (final,) = handed  # a new value; the planned facts keep the planned counts
    assert torch.equal(final.loss_tokens, mask.sum(-1) * ~facts.is_padding)
    assert torch.equal(facts.loss_tokens, data.batch["response_mask"].sum(-1) * ~facts.is_padding)
    assert not torch.equal(final.loss_tokens, facts.loss_tokens) and final.keys == facts.keys
    with pytest.raises(TypeError):
        final.advantage_metrics["x"] = 1.0  # read-only


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
                                  "traj-mean"])
def test_loss_weights_from_counts_are_the_mask_weights(mode):
    """v1's driver keeps each row's loss-token count, not the ``[B, R]`` mask: the weights from the counts equal the
    weights from the mask (union of mini-batches included); without ``S`` (no data.max_response_length) refused."""
    from verl_traj.integration.config.update_spec import LossSpec

    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(10, 7, generator=g) < 0.6).long()
    mb, traj = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 3, 3]), torch.tensor([0, 0, 1, 2, 2, 3, 4, 4, -1, 5])
    pad = traj < 0
    spec = LossSpec(mode, 7.0, union=2)
    torch.testing.assert_close(spec.weights_from_counts(mask.sum(-1) * ~pad, mb, traj, pad),
                               spec.weights(mask * ~pad[:, None], mb, traj, pad))
    with pytest.raises(TrajConfigError, match="data.max_response_length"):
        LossSpec(mode, None).weights_from_counts(mask.sum(-1), mb, traj, pad)


def test_plan_facts_follow_the_plan_order():
    keys = ["g0_0_0", "g0_0_1", "g0_1_0", "g1_0_0", "g1_1_0", "g1_1_1", "g1_1_2"]
    parsed = parse_row_keys(keys)
    layout = build_layout_from_counts(torch.tensor([5, 6, 7, 4, 3, 8, 2]), torch.tensor([2, 2, 3, 1, 1, 4, 1]),
                                      parsed.uid, traj_id=parsed.traj_id, step_index=parsed.step)
    plan = plan_mini_batches(layout, 2, 2)
    out_keys = [keys[i] if i >= 0 else f"pad{j}_0_0" for j, i in enumerate(plan.order.tolist())]
    fields, lengths = {"mini_batch_id": plan.mini_batch_id}, torch.arange(len(out_keys))
    facts = plan_facts(SimpleNamespace(keys=out_keys, tags=[{}] * len(out_keys)), plan, layout, fields, lengths)
    assert dict(facts.row_fields) == fields and facts.row_length is lengths and torch.equal(facts.rank, plan.rank)
    last_key = {"g0_0": "g0_0_1", "g0_1": "g0_1_0", "g1_0": "g1_0_0", "g1_1": "g1_1_2"}
    expected = [not k.startswith("pad") and last_key[k.rsplit("_", 1)[0]] == k for k in out_keys]
    assert facts.is_last_step.tolist() == expected
    assert facts.is_padding.tolist() == [k.startswith("pad") for k in out_keys]
    assert facts.multi_row and facts.mini_batch_id.tolist() == plan.mini_batch_id.tolist()
    loss_tokens = {k: int(n) for k, n in zip(keys, layout.num_loss_tokens)}  # counted at planning, 0 on padding
    assert facts.loss_tokens.tolist() == [loss_tokens.get(k, 0) for k in out_keys]


def test_padding_row_has_the_source_schema_and_no_loss():
    source = {"prompts": torch.arange(5), "responses": torch.arange(3), "input_ids": torch.arange(8),
              "attention_mask": torch.ones(8, dtype=torch.long), "position_ids": torch.arange(8),
              "response_mask": torch.ones(3, dtype=torch.long), "loss_mask": torch.ones(3, dtype=torch.long),
              "rm_scores": torch.tensor([0.0, 0.0, 1.0]), "rollout_log_probs": -torch.ones(3), "uid": "g",
              "session_id": 1, "num_turns": 3, "data_source": "d"}
    tag = {"status": "success", "seq_len": 8, "min_global_steps": 2, "max_global_steps": 3,
           # the source session's verl_traj tags, which verl's template copies: a padding row carries none of them
           "traj_turn_rewards": [[2, 1.0]], "traj_step_anchors": [[0, 99]], "traj_loss_tokens": 3,
           "traj_prefix_hashes": b"\x00" * 8, "traj_merge": {"rows_before": 3}}
    row, pad_tag = padding_row(source, tag, eos_token_id=7, length=2)
    assert not [k for k in pad_tag if k.startswith("traj_")] and "traj_turn_rewards" in tag
    assert set(row) == set(source)
    assert row["input_ids"].tolist() == [7, 7] and row["attention_mask"].tolist() == [1, 1]
    assert row["response_mask"].tolist() == [0] and float(row["rm_scores"].abs().sum()) == 0
    assert pad_tag["is_padding"] and pad_tag["seq_len"] == 2 and pad_tag["min_global_steps"] == 2
    assert source["response_mask"].tolist() == [1, 1, 1]  # the source is untouched


def test_stock_plan_metrics_count_what_fixed_slices_split():
    from verl_traj.integration.trainers.step_plan import stock_plan_metrics

    keys = [f"g{g}_{s}_{k}" for g in range(2) for s in range(2) for k in range(3)]  # 2 groups x 2 sessions x 3 steps
    uid, traj = parse_row_keys(keys).uid, parse_row_keys(keys).traj_id
    m = stock_plan_metrics(uid, traj, None, dp_size=1, rows_per_mini_batch=4, epochs=1)
    assert m["stock_plan/num_mini_batches"] == 3
    assert m["stock_plan/split_trajectories"] == 2 and m["stock_plan/split_groups"] == 2


def test_update_spec_one_derivation_for_both_trainers():
    """Both adapters read one UpdateSpec: the same config on v0 and v1 gives the same facts, and S of
    seq-mean-token-sum-norm is data.max_response_length on both (v0 once used the batch's response width, which
    changes from step to step with step rows)."""
    from verl_traj.integration.trainers.step_plan import check_same_dp_size
    from verl_traj.integration.config.update_spec import LossSpec, UpdateSpec

    base = {"data": {"train_batch_size": 8, "max_response_length": 12},
            "algorithm": {"adv_estimator": "gae"},
            "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 2, "ppo_epochs": 2,
                                            "loss_agg_mode": "seq-mean-token-sum-norm"}},
            "critic": {"loss_agg_mode": "token-mean"}}
    v0 = UpdateSpec.derive(OmegaConf.create(base), TrajConfig(), None)
    v1 = UpdateSpec.derive(OmegaConf.create({**base, "trainer": {"use_v1": True}}), TrajConfig(), None)
    assert v0 == v1
    assert v0.num_mini_batches == 4 and v0.epochs == 2 and v0.critic_union == 1  # critic mini-batch unset: the actor's
    assert v0.actor_loss == LossSpec("seq-mean-token-sum-norm", 12.0)
    assert v0.critic_loss == LossSpec("token-mean", 12.0)
    critic8 = OmegaConf.create({**base, "critic": {"ppo_mini_batch_size": 8, "loss_scale_factor": 3}})
    spec = UpdateSpec.derive(critic8, TrajConfig(critic_loss_agg_mode="traj-mean"), None)
    assert spec.critic_union == 4 and spec.critic_loss == LossSpec("traj-mean", 3.0, union=4)  # one step: all four
    # the critic's weights are normalised over its own optimizer step (the union), not per actor mini-batch:
    # regression of the first PPO runs, whose critic steps on a union of 2 carried twice the weight
    mb = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    w = spec.critic_loss.weights(torch.ones(8, 5), mb, torch.arange(8), torch.zeros(8, dtype=torch.bool))
    assert float((w * 5).sum()) == pytest.approx(1.0)
    sync4 = OmegaConf.create({**base, "trainer": {"use_v1": True, "v1": {"trainer_mode": "sync",
                                                                         "sync": {"parameter_sync_step": 2}}}})
    spec = UpdateSpec.derive(sync4, TrajConfig(seed=10), None)
    assert spec.prompts_per_update == 4 and spec.num_mini_batches == 2
    assert spec.plan_seed(3, 1) == 10 + 3 * 2 + 1 and v0.plan_seed(3) == 3  # one seed per local update
    # the weights S gives do not depend on the batch's response width
    mask = torch.ones(2, 5)
    w_narrow = v0.actor_loss.weights(mask, torch.zeros(2, dtype=torch.long), torch.arange(2), torch.zeros(2))
    w_wide = v0.actor_loss.weights(torch.nn.functional.pad(mask, (0, 20)), torch.zeros(2, dtype=torch.long),
                                   torch.arange(2), torch.zeros(2))
    assert torch.equal(w_narrow, w_wide) and torch.allclose(w_narrow, torch.full((2,), 1 / (2 * 12)))
    assert check_same_dp_size(2, None) == 2 and check_same_dp_size(2, 2) == 2
    with pytest.raises(TrajConfigError, match="actor DP size 2 != critic DP size 4"):
        check_same_dp_size(2, 4)


def test_stepwise_metrics_sum_the_session_tags():
    from verl_traj.core.rollout.row_tags import MERGE_TAG

    one = {"rows_before": 3, "rows_after": 1, "tokens_before": 30, "tokens_after": 14, "loss_tokens_before": 6,
           "loss_tokens_after": 6}
    tags = [{MERGE_TAG: one}, {}, {MERGE_TAG: dict(one, rows_after=2, tokens_after=20)}]
    m = stepwise_metrics(tags)
    assert m["traj_stepwise/rows_before"] == 6 and m["traj_stepwise/rows_after"] == 3
    assert m["traj_stepwise/token_ratio"] == pytest.approx(60 / 34) and m["traj_stepwise/trajectories"] == 2
    assert stepwise_metrics([{}, {}]) == {}


def test_every_registered_mode_gets_the_mixin_and_the_registry_is_restored():
    import verl.trainer.ppo.v1 as v1_pkg
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    from verl_traj.integration.patches.scoped import patched, v1_task_runner_patches

    original = v1_pkg.get_trainer_cls
    with patched(v1_task_runner_patches(V1.traj_trainer_class)):
        for name, cls in TRAINER_REGISTRY.items():
            traj_cls = v1_pkg.get_trainer_cls(name)
            assert traj_cls.__mro__[1] is V1.TrajV1Mixin and issubclass(traj_cls, cls)
            assert v1_pkg.get_trainer_cls(name) is traj_cls  # one class per mode
    assert v1_pkg.get_trainer_cls is original
    assert set(TRAINER_REGISTRY) >= {"sync", "colocate_async", "separate_async"}


def test_each_role_gets_its_traj_worker_and_the_critic_its_traj_loss():
    """The entry's role wiring (one function for v1's trainers; v0's runner wires the same classes), and the critic's
    loss set where verl's trainers set ``value_loss`` (regression: both trainers used to install it from the driver)."""
    from functools import partial

    from verl.experimental.separation.engine_workers import DetachActorWorker
    from verl.trainer.ppo.utils import Role
    from verl.workers.utils.losses import value_loss

    from verl_traj.core.errors import TrajInputError
    from verl_traj.integration.workers.engine_workers import (TrajActorMixin, TrajCriticWorker, traj_role_worker)
    from verl_traj.integration.workers.losses import traj_value_loss

    assert traj_role_worker(Role.Critic, object) is TrajCriticWorker
    assert issubclass(traj_role_worker(Role.ActorRollout, DetachActorWorker), DetachActorWorker)
    assert issubclass(traj_role_worker(Role.RefPolicy, DetachActorWorker), TrajActorMixin)
    assert traj_role_worker(Role.RewardModel, object) is None  # verl's own
    critic = object.__new__(TrajCriticWorker)
    config = object()
    critic.set_loss_fn(partial(value_loss, config=config))
    assert critic.loss_fn.func is traj_value_loss and critic.loss_fn.keywords["config"] is config
    with pytest.raises(TrajInputError, match="value_loss"):
        critic.set_loss_fn(value_loss)


def test_a_v1_trainer_without_traj_workers_refuses_to_start_them():
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    cls = V1.traj_trainer_class(PPOTrainerSync)
    trainer = object.__new__(cls)
    trainer.traj_config = TrajConfig()
    with pytest.raises(RuntimeError, match="traj_role_worker"):
        trainer._init_resource_pool_mgr()


def test_separate_async_actor_worker_gets_the_traj_actor():
    from verl.experimental.separation.engine_workers import DetachActorWorker
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from verl_traj.integration.workers.engine_workers import TrajActorMixin, TrajActorRolloutRefWorker, traj_actor_worker

    detach = traj_actor_worker(DetachActorWorker)
    assert issubclass(detach, TrajActorMixin) and issubclass(detach, DetachActorWorker)
    assert traj_actor_worker(DetachActorWorker) is detach
    assert traj_actor_worker(ActorRolloutRefWorker) is TrajActorRolloutRefWorker
    with pytest.raises(TypeError, match="ActorRolloutRefWorker"):
        traj_actor_worker(dict)


def _v1_config(**over):
    base = {"trainer": {"use_v1": True, "v1": {"trainer_mode": "sync", "separate_async": {"parameter_sync_step": 4}}},
            "data": {"train_batch_size": 8},
            "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 2, "policy_loss": {"loss_mode": "vanilla"}}},
            "algorithm": {"adv_estimator": "grpo"}}
    cfg = OmegaConf.create(base)
    for key, value in over.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def test_v1_is_accepted_and_updates_are_counted_per_local_update():
    validate_against_verl(TrajConfig(), _v1_config())
    validate_against_verl(TrajConfig(), _v1_config(**{"trainer.v1.trainer_mode": "separate_async"}))  # 8/4 = 2 prompts
    with pytest.raises(TrajConfigError, match=r"train_batch_size / parameter_sync_step=2 .*ppo_mini_batch_size=4"):
        validate_against_verl(TrajConfig(), _v1_config(**{"trainer.v1.trainer_mode": "separate_async",
                                                           "actor_rollout_ref.actor.ppo_mini_batch_size": 4}))
    with pytest.raises(TrajConfigError, match="parameter_sync_step=3"):
        validate_against_verl(TrajConfig(), _v1_config(**{"trainer.v1.sync.parameter_sync_step": 3}))


def test_v1_selects_the_traj_agent_loop_manager_and_keeps_the_users_own():
    from verl_traj.integration.agent_loops.v1_agent_loop import TrajAgentLoopManagerTQ
    from verl.utils.import_utils import load_class_from_fqn

    from verl_traj.integration.config.verl_config import MANAGER_FQN, prepare_v1_agent_loop

    assert load_class_from_fqn(MANAGER_FQN) is TrajAgentLoopManagerTQ  # the name start-up writes is the class

    key = "actor_rollout_ref.rollout.agent.agent_loop_manager_class"
    cfg = _v1_config(**{key: None})
    prepare_v1_agent_loop(cfg, TrajConfig())
    assert OmegaConf.select(cfg, key) == MANAGER_FQN
    own = "verl.trainer.ppo.v1.agent_loop_tq.AgentLoopManagerTQ"
    cfg = _v1_config(**{key: own})
    prepare_v1_agent_loop(cfg, TrajConfig())
    assert OmegaConf.select(cfg, key) == own  # kept without step-wise rows
    with pytest.raises(TrajConfigError, match="agent_loop_manager_class=.*AgentLoopManagerTQ.*step_wise"):
        prepare_v1_agent_loop(cfg, TrajConfig(step_wise=True))


def test_session_priorities_are_unique_and_run_independent():
    from verl_traj.integration.agent_loops.v1_agent_loop import session_priority

    ids = {session_priority(i, s, 4) for i in range(50) for s in range(4)}
    assert len(ids) == 200 and session_priority(7, 2, 4) == 30
    # a non-integer index hashes with crc32, not Python's per-process salted hash(): the same number in every run
    assert session_priority("row-a", 1, 4) == zlib.crc32(b"row-a") * 4 + 1 != session_priority("row-b", 1, 4)


@pytest.mark.parametrize("merge", [False, True])
def test_a_scored_trajectory_becomes_its_step_rows(merge):
    """What the v1 agent-loop worker stores for one step-wise session: each LLM call's own context and tokens
    (or the prefix-merged rows), the reward on the last row only, the records dropped, every loss token kept."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    from verl_traj.integration.agent_loops.v1_agent_loop import step_outputs
    from verl_traj.stepwise.expand import encode_step_records
    from verl_traj.testing import token_trajectory

    records, prompt, response, mask, lps = token_trajectory(np.random.default_rng(0), 3, break_at=2)
    out = AgentLoopOutput(prompt_ids=prompt.tolist(), response_ids=response.tolist(), response_mask=mask.tolist(),
                          response_logprobs=lps.tolist(), reward_score=0.7, num_turns=6, metrics=AgentLoopMetrics(),
                          extra_fields={"traj_steps": encode_step_records(records), "tool": 1})
    rows, tags, stats = step_outputs(out, merge)
    assert tags[0] == {} and not any(tags)  # no turn rewards in these records
    assert len(rows) == (2 if merge else 3)  # the context is rewritten before call 2: calls 0 and 1 merge
    assert [r.reward_score for r in rows] == [None] * (len(rows) - 1) + [0.7]
    assert all(r.extra_fields == {"tool": 1} for r in rows)
    assert sum(sum(r.response_mask) for r in rows) == int(mask.sum())
    assert stats["rows_before"] == 3 and stats["rows_after"] == len(rows)
    last = records[-1]
    assert rows[-1].prompt_ids == list(last["prompt_ids"]) and rows[-1].response_ids == list(last["response_ids"])
    assert rows[-1].response_logprobs == pytest.approx(list(last["response_logprobs"]))
    if not merge:
        assert [r.prompt_ids for r in rows] == [list(rec["prompt_ids"]) for rec in records]


@pytest.mark.parametrize("field, value", [("routed_experts", [[1, 2]] * 4), ("multi_modal_data", {"image": ["x"]})])
def test_step_rows_refuse_what_they_cannot_carry(field, value):
    """Regression (issue 21): v1 step rows were built without routed_experts (MoE router replay) and multi-modal
    data, silently; v0 refuses them. Now v1 refuses them too, naming the field and the fix."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    from verl_traj.integration.agent_loops.v1_agent_loop import step_outputs
    from verl_traj.stepwise.expand import StepExpansionError, encode_step_records
    from verl_traj.testing import token_trajectory

    records, prompt, response, mask, lps = token_trajectory(np.random.default_rng(0), 2)
    out = AgentLoopOutput(prompt_ids=prompt.tolist(), response_ids=response.tolist(), response_mask=mask.tolist(),
                          metrics=AgentLoopMetrics(), extra_fields={"traj_steps": encode_step_records(records)},
                          **{field: value})
    with pytest.raises(StepExpansionError, match=f"{field}.*traj.step_wise=false") as err:
        step_outputs(out, merge_prefix=True)
    assert err.value.field == field


def test_a_multi_turn_trajectory_without_step_records_is_refused_under_step_wise_and_a_single_turn_one_is_not():
    """Regression (issue 31): with traj.step_wise=true a loop without StepRecordingMixin trained its multi-turn
    trajectories as one row each, silently."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    from verl_traj.integration.agent_loops.v1_agent_loop import check_recorded
    from verl_traj.stepwise.expand import StepExpansionError

    def output(turns):
        return AgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[1], num_turns=turns,
                               metrics=AgentLoopMetrics(), extra_fields={})

    check_recorded(output(2), "single_turn_agent")  # one call: its one row is the step row
    with pytest.raises(StepExpansionError, match=r"'my_loop'.*6 turns without step records.*StepRecordingMixin") as err:
        check_recorded(output(6), "my_loop")
    assert err.value.field == "traj.step_wise"
    check_recorded([output(2), output(2)], "list_loop")  # verl's rows, one per output
    with pytest.raises(StepExpansionError, match=r"gigpo.*'list_loop' returned a list") as err:  # no calls to key
        check_recorded([output(2), output(2)], "list_loop", anchors=True)
    assert err.value.every_rollout


def test_the_policy_versions_verl_reads_are_filled_from_the_recorded_calls_or_refused_with_the_fix():
    """Regression (issue 31): a loop of one's own that built its output without extra_fields' min/max_global_steps
    crashed inside verl's v1 metrics (int(None))."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    from verl_traj.core.rollout.session_ledger import SessionLedger
    from verl_traj.integration.agent_loops.v1_agent_loop import check_version_fields
    from verl_traj.stepwise.expand import StepExpansionError

    out = AgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[1], metrics=AgentLoopMetrics(),
                          extra_fields={})
    with pytest.raises(StepExpansionError, match=r"'mine'.*min_global_steps.*Fix: copy the server output"):
        check_version_fields(out, "mine")
    SessionLedger(attempts=[(4, 3), (5, 0), (6, 2)]).fill_version_fields(out.extra_fields)
    assert (out.extra_fields["min_global_steps"], out.extra_fields["max_global_steps"]) == (4, 6)
    check_version_fields(out, "mine")


def test_last_rows_of_trajectories_pick_each_trajectorys_highest_step():
    """``traj_reward/*`` reads one score per trajectory: its last row (highest step, whatever the row order),
    never a padding row."""
    keys = ["g0_0_1", "g0_0_0", "g0_1_0", "pad7_0_0", "g1_0_2", "g1_0_10", "g1_0_3"]
    pad = np.array([k.startswith("pad") for k in keys])
    assert last_rows_of_trajectories(keys, pad).tolist() == [0, 2, 5]


def test_v1_trajectory_ratios_equal_v0s():
    """v1 corrects before it computes advantages, so its wrapper attaches the plan's facts first; then verl's
    rollout correction per trajectory gives v0's weights and mask exactly (sequence IS, geometric-mean rejection)."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch as verl_add

    from verl_traj.integration.rows.stepwise_rows import trajectory_scoped_correction

    torch.manual_seed(0)
    data, _ = planned_stepwise_batch(3)
    td = data.batch
    td["old_log_probs"] = td["rollout_log_probs"] + 0.05 * ((td["responses"] % 7).float() - 3) * (td["response_mask"] != 0)
    config = OmegaConf.create({"rollout_is": "sequence", "rollout_is_threshold": 50.0, "rollout_rs": "seq_mean_k1",
                               "rollout_rs_threshold": "0.98_1.02"})
    keys, scores, facts = _v1_view(data)
    v1 = as_dataproto({k: td[k].clone() for k in ("old_log_probs", "rollout_log_probs", "response_mask", "attention_mask")},
                      {"uid": parse_row_keys(keys).uid})
    v1, v1_metrics = corrected_per_trajectory(facts, verl_add, v1, config)
    v0, v0_metrics = trajectory_scoped_correction(verl_add)(data, config)
    real = ~facts.is_padding
    torch.testing.assert_close(v1.batch["rollout_is_weights"][real], v0.batch["rollout_is_weights"][real])
    assert torch.equal(v1.batch["response_mask"][real], v0.batch["response_mask"][real])
    assert v1_metrics == pytest.approx(v0_metrics)


def test_a_steps_length_bias_reads_each_trained_trajectorys_last_row_and_the_cut_ones():
    """traj_bias/* on v1: the trained trajectories' lengths from their last rows' tags (padding rows and earlier rows
    ignored), against what the replay buffer let go, by cause."""
    from transfer_queue import KVBatchMeta

    from verl_traj.core.rollout.length_bias import Lengths
    from verl_traj.core.rollout.session_ledger import LENGTH_TAG
    from verl_traj.integration.trainers.v1_metrics import length_bias_metrics

    keys = ["u1_0_0", "u1_0_1", "u1_1_0", "u2_0_0", "pad_0_0"]
    tags = [{}, {LENGTH_TAG: [100, 4]}, {LENGTH_TAG: [60, 2]}, {LENGTH_TAG: [20, 1]}, {"is_padding": True}]
    meta = KVBatchMeta(keys=keys, tags=tags, partition_id="train")
    out = length_bias_metrics(meta, {"stale": Lengths.of([300], [12])})
    assert out["traj_bias/trajectories_trained"] == 3 and out["traj_bias/trajectories_cut"] == 1
    assert out["traj_bias/tokens_mean_ratio"] == pytest.approx(60 / 120)  # trained 100, 60, 20; all + 300
    assert out["traj_bias/turns_mean_ratio"] == pytest.approx((7 / 3) / (19 / 4))
    assert out["traj_bias/stale_share"] == 0.25 and out["traj_bias/stale_tokens_mean_ratio"] == pytest.approx(2.5)
    assert length_bias_metrics(meta, {})["traj_bias/tokens_mean_ratio"] == 1.0  # nothing let go: no bias
