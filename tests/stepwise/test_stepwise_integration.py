"""verl adapters: DataProto expansion, the step-aware compute_advantage on planned batches, agent-loop
registration, and the trainer's expand -> plan -> advantage chain."""

import asyncio

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl import DataProto
from verl.trainer.ppo import ray_trainer
from verl.trainer.ppo.core_algos import get_adv_estimator_fn

from tests.stepwise.helpers import trajectory_advantages
from tests.stepwise.verl_batches import planned_stepwise_batch, stepwise_dataproto, stepwise_trainer
from verl_traj.config import TrajConfig
from verl_traj.core.keys import TURN_REWARDS
from verl_traj.integration.agent_loops import stepwise_agent_loop as sal
from verl_traj.integration.rows.stepwise_rows import expand_dataproto_step_rows, stepwise_advantage
from verl_traj.stepwise.advantages import StepwiseAdvantageError
from verl_traj.testing import step_record_batch as make_batch, token_trajectory as make_trajectory

step_advantage = stepwise_advantage(ray_trainer.compute_advantage)


@pytest.mark.parametrize("merge", [False, True])
def test_expand_dataproto_in_place(merge):
    data, trajs = stepwise_dataproto()
    metrics = expand_dataproto_step_rows(data, merge_prefix=merge)
    n_steps = sum(len(t[0]) for t in trajs)
    assert len(data) == (4 if merge else n_steps)
    assert metrics["traj_stepwise/rows_before"] == n_steps
    assert metrics["traj_stepwise/rows_after"] == len(data)
    assert data.meta_info == {"k": 1}
    assert set(data.non_tensor_batch) >= {"uid", "traj_id", "step_index", "is_last_step", "data_source"}
    assert data.batch["input_ids"].shape[0] == len(data)
    assert expand_dataproto_step_rows(data) == {} and len(data) == (4 if merge else n_steps)  # idempotent
    from verl_traj.core import build_layout

    nt = data.non_tensor_batch
    layout = build_layout(data.batch["attention_mask"], data.batch["response_mask"], nt["uid"], nt["traj_id"],
                          nt["step_index"], nt["is_last_step"])
    assert layout.num_trajectories == 4 and layout.num_groups == 2


@pytest.mark.parametrize("name", ["grpo", "rloo", "grpo_vectorized", "opo"])
def test_step_advantage_matches_pure_function(name):
    data, _ = planned_stepwise_batch(1)
    nt, pad = data.non_tensor_batch, data.batch["is_padding"].numpy()
    ref, *_ = trajectory_advantages(
        data.batch["rm_scores"], data.batch["response_mask"], nt["uid"], nt["traj_id"], nt["is_last_step"], pad,
        estimator_fn=get_adv_estimator_fn(name), estimator_name=name,
    )
    out = step_advantage(data, name, norm_adv_by_std_in_grpo=True, config=OmegaConf.create({}))
    assert torch.allclose(out.batch["advantages"], ref)
    earlier = ~torch.as_tensor(nt["is_last_step"]) & ~data.batch["is_padding"]
    assert torch.count_nonzero(out.batch["advantages"][earlier]) > 0  # earlier steps carry the outcome too
    assert torch.count_nonzero(out.batch["advantages"][data.batch["is_padding"]]) == 0


def _loss_token_credit(data, key):
    """{trajectory id: [per loss token ``key`` in time order]} of a planned step-wise batch."""
    td, nt = data.batch, data.non_tensor_batch
    out = {}
    order = sorted(range(len(data)), key=lambda b: (str(nt["traj_id"][b]), int(nt["step_index"][b])))
    for b in order:
        if bool(td["is_padding"][b]):
            continue
        out.setdefault(str(nt["traj_id"][b]), []).extend(td[key][b][td["response_mask"][b] != 0].tolist())
    return out


@pytest.mark.parametrize("name", ["gae", "reinforce_plus_plus"])
def test_temporal_estimators_give_step_rows_and_merged_rows_the_same_credit(name):
    """Real expansion (tests' token trajectories, whose contexts are rewritten before some calls): the same
    trajectories as unmerged step rows and as prefix-merged rows, with padding rows from the plan. A response token's
    value is a function of the token (the same in both layouts); the outcome sits on the last step. A temporal
    estimator on the timeline gives every loss token the same advantage and return in both layouts."""
    config = OmegaConf.create({"gamma": 0.95})
    credit = {}
    for merge in (False, True):
        torch.manual_seed(0)  # token_trajectory draws its token ids from torch's generator: the same in both layouts
        data, _ = planned_stepwise_batch(4, merge=merge)
        data.batch["values"] = (data.batch["responses"].float() % 7) * 0.1
        step_advantage(data, name, gamma=0.95, lam=0.9, config=config)
        credit[merge] = (_loss_token_credit(data, "advantages"), _loss_token_credit(data, "returns"))
        assert torch.all(data.batch["advantages"][data.batch["is_padding"]] == 0)
    for got, want in zip(credit[True], credit[False]):
        assert got.keys() == want.keys()
        for traj in got:
            assert got[traj] == pytest.approx(want[traj], rel=1e-5, abs=1e-6), traj


def test_step_advantage_refuses_what_has_no_step_row_path_and_leaves_plain_batches_to_verl():
    data, _ = planned_stepwise_batch(2)
    with pytest.raises(StepwiseAdvantageError, match="gdpo"):
        step_advantage(data, "gdpo", config=OmegaConf.create({}))
    plain, _ = stepwise_dataproto(2)
    plain.batch["token_level_rewards"] = plain.batch["rm_scores"].clone()
    ref = ray_trainer.compute_advantage(plain, "grpo", config=OmegaConf.create({}))
    plain2, _ = stepwise_dataproto(2)
    plain2.batch["token_level_rewards"] = plain2.batch["rm_scores"].clone()
    got = step_advantage(plain2, "grpo", config=OmegaConf.create({}))
    assert torch.allclose(got.batch["advantages"], ref.batch["advantages"])


def test_kl_in_reward_uses_sum_over_steps():
    data, _ = planned_stepwise_batch(3)
    tlr = data.batch["rm_scores"].clone() - 0.01 * data.batch["response_mask"].float()  # KL penalty on every row
    data.batch["token_level_rewards"] = tlr
    out = step_advantage(data, "rloo", config=OmegaConf.create({"use_kl_in_reward": True}))
    nt = data.non_tensor_batch
    ref, *_ = trajectory_advantages(
        tlr, data.batch["response_mask"], nt["uid"], nt["traj_id"], nt["is_last_step"], data.batch["is_padding"].numpy(),
        estimator_fn=get_adv_estimator_fn("rloo"), estimator_name="rloo", reward_reduction="sum",
    )
    assert torch.allclose(out.batch["advantages"], ref)


def test_agent_loop_registered_and_importable_by_hydra_target():
    from hydra.utils import get_class
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    entry = _agent_loop_registry[sal.AGENT_LOOP_NAME]
    assert get_class(entry["_target_"]) is sal.StepwiseToolAgentLoop
    # the in-code yaml and the registry (which the shipped yaml, naming the public verl_traj.agent_loops, may have
    # re-registered earlier in the process) name the same class
    assert get_class(OmegaConf.create(sal.AGENT_LOOP_CONFIG_YAML)[0]["_target_"]) is get_class(entry["_target_"])


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
        {"prompt_ids": [1, 2], "response_ids": [2], "response_logprobs": [-0.5], "parent": -1},
        {"prompt_ids": [1, 2, 2, 7], "response_ids": [4], "response_logprobs": [-0.5], "parent": 0},
    ]


@pytest.mark.parametrize("merge", [False, True])
def test_expand_plan_pad_then_advantages_end_to_end(merge):
    """The _balance_batch chain: expand -> plan (padding rows at dp=3) -> step-aware advantages equal those of
    the unplanned rows, padding rows get none."""
    from verl_traj.core import build_layout

    rng = np.random.default_rng(11)
    trajs = [make_trajectory(rng, int(rng.integers(1, 5))) for _ in range(8)]
    tensors, non = make_batch(trajs, [f"g{i // 2}" for i in range(8)], [float(x) for x in rng.random(8)])
    data = DataProto.from_dict(tensors=tensors, non_tensors=non)
    expand_dataproto_step_rows(data, merge_prefix=merge)
    nt = data.non_tensor_batch
    ref, *_ = trajectory_advantages(data.batch["rm_scores"], data.batch["response_mask"], nt["uid"], nt["traj_id"],
                                    nt["is_last_step"], estimator_fn=get_adv_estimator_fn("grpo"))
    layout = build_layout(data.batch["attention_mask"], data.batch["response_mask"], nt["uid"], nt["traj_id"],
                          nt["step_index"], nt["is_last_step"])
    source_traj = layout.traj_index.clone()
    tr = stepwise_trainer(TrajConfig(step_wise=True, merge_prefix=merge), dp=3)
    tr.config.data.train_batch_size = 4
    plan = tr.plan_and_apply(data, 3)
    data.batch["token_level_rewards"] = data.batch["rm_scores"].clone()
    adv = step_advantage(data, "grpo", config=OmegaConf.create({})).batch["advantages"]
    pad = plan.is_padding
    assert int(pad.sum()) == int(plan.stats.padding_rows.sum()) > 0
    assert torch.count_nonzero(adv[pad]) == 0
    assert torch.allclose(adv[~pad], ref[plan.order[~pad]])
    assert torch.equal(data.batch["traj_index"][~pad], source_traj[plan.order[~pad]])  # the layout's numbering


def test_trainer_expands_before_planning_and_patches_advantage_only_inside_fit():
    """TrajRayPPOTrainer with traj.step_wise: _balance_batch expands to step rows, then plans them (real
    planner, dp=2); fit runs with the step-aware compute_advantage under the real-rows wrapper, restored after."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    data, trajs = stepwise_dataproto(7)
    n_steps = sum(len(t[0]) for t in trajs)
    metrics = {}
    stepwise_trainer(TrajConfig(step_wise=True, merge_prefix=False))._balance_batch(data, metrics)
    assert metrics["traj_stepwise/rows_after"] == n_steps == metrics["traj_plan/real_rows"]
    assert metrics["traj_plan/split_trajectories"] == 0 and metrics["traj_plan/split_groups"] == 0
    real = ~data.batch["is_padding"]
    assert int(real.sum()) == n_steps and len(data) % 2 == 0
    assert {"traj_id", "step_index", "is_last_step"} <= set(data.non_tensor_batch)

    seen = {}
    original, original_fit = ray_trainer.compute_advantage, RayPPOTrainer.fit
    RayPPOTrainer.fit = lambda self: seen.setdefault("compute_advantage", ray_trainer.compute_advantage)
    try:
        stepwise_trainer(TrajConfig(step_wise=True)).fit()
    finally:
        RayPPOTrainer.fit = original_fit
    step_wrapper = seen["compute_advantage"].__wrapped__  # real rows outside, the step-wise adapter inside
    assert step_wrapper.__name__ == "compute_advantage" and step_wrapper.__wrapped__ is original
    assert ray_trainer.compute_advantage is original


def test_non_finite_values_on_the_timeline_are_refused_by_name():
    """A NaN value would spread through every earlier turn of its trajectory: refused where it enters, naming the
    field; padding rows' values are not looked at."""
    data, _ = planned_stepwise_batch(5)
    data.batch["values"] = torch.zeros_like(data.batch["token_level_rewards"])
    pad = data.batch["is_padding"]
    data.batch["values"][pad] = float("nan")  # padding rows: ignored
    step_advantage(data, "gae", gamma=1.0, lam=1.0, config=OmegaConf.create({}))
    data.batch["values"][int(torch.nonzero(~pad)[0])] = float("nan")
    with pytest.raises(StepwiseAdvantageError, match="values holds .* non-finite") as err:
        step_advantage(data, "gae", gamma=1.0, lam=1.0, config=OmegaConf.create({}))
    assert err.value.field == "values"


def _planned_with_turn_rewards(seed, merge):
    torch.manual_seed(0)
    return planned_stepwise_batch(seed, merge=merge, turn_rewards=True)[0]


def test_turn_rewards_land_on_each_calls_last_token_in_both_layouts():
    """Each LLM call's own reward sits on its last response token, in step rows and inside merged rows alike; the
    trajectories' totals are kept (0.1 + 0.2 + 0.3 for a 4-call trajectory, ...)."""
    totals = {}
    for merge in (False, True):
        data = _planned_with_turn_rewards(6, merge)
        turn, mask = data.batch[TURN_REWARDS], data.batch["response_mask"]
        assert torch.all((turn != 0) <= (mask != 0))  # only on loss tokens
        totals[merge] = sorted(round(float(turn[data.batch["traj_index"] == t].sum()), 6)
                               for t in range(int(data.batch["traj_index"].max()) + 1))
    assert totals[False] == totals[True] == sorted([0.3, 0.1, 0.6, 0.0])


@pytest.mark.parametrize("name", ["gae", "grpo"])
def test_turn_rewards_give_step_rows_and_merged_rows_the_same_credit(name):
    """Temporal (GAE): the turn rewards discount through the timeline; outcome (GRPO): a trajectory's score is its
    outcome plus its turn rewards. Either way unmerged and merged rows get the same credit on every loss token, and
    the turn rewards change it (they are not dropped)."""
    config = OmegaConf.create({"gamma": 0.9})
    credit = {}
    for merge in (False, True):
        data = _planned_with_turn_rewards(6, merge)
        data.batch["values"] = (data.batch["responses"].float() % 5) * 0.1
        step_advantage(data, name, gamma=0.9, lam=0.95, config=config)
        credit[merge] = _loss_token_credit(data, "advantages")
        data.batch.pop(TURN_REWARDS)
        step_advantage(data, name, gamma=0.9, lam=0.95, config=config)
        credit[(merge, "outcome only")] = _loss_token_credit(data, "advantages")
    for traj in credit[False]:
        assert credit[False][traj] == pytest.approx(credit[True][traj], rel=1e-5, abs=1e-6), traj
    assert any(credit[False][t] != pytest.approx(credit[(False, "outcome only")][t], abs=1e-4) for t in credit[False])


@pytest.mark.parametrize("merge", [False, True])
def test_v1_step_rows_carry_turn_rewards_as_sparse_tags(merge):
    """v1's row fields are fixed, so each step row's turn rewards travel as a tag: ``[[position, reward], ...]`` on
    the row's own response tokens, each call's on its last loss token; decoded, the rows hold every reward once.
    Stock verl (``turn_rewards=False``: ``traj.enable=false``) has no channel and refuses them by name."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    from verl_traj.core.rollout.row_tags import turn_reward_entries

    from verl_traj.integration.agent_loops.v1_agent_loop import step_outputs
    from verl_traj.stepwise.expand import StepExpansionError, encode_step_records

    records, prompt, response, mask, _ = make_trajectory(np.random.default_rng(0), 3)
    records[0]["reward"], records[1]["reward"] = 0.5, -0.25
    out = AgentLoopOutput(prompt_ids=prompt.tolist(), response_ids=response.tolist(), response_mask=mask.tolist(),
                          metrics=AgentLoopMetrics(), extra_fields={"traj_steps": encode_step_records(records)})
    rows, tags, _ = step_outputs(out, merge_prefix=merge)
    row, pos, reward = turn_reward_entries(tags)
    assert sorted(reward.tolist()) == [-0.25, 0.5]
    for b, p in zip(row.tolist(), pos.tolist()):  # on a loss token of the row, the last of its call
        assert rows[b].response_mask[p] == 1
    if not merge:  # one row per call: each reward on its call's last loss token
        assert [(b, p) for b, p in zip(row.tolist(), pos.tolist())] == [
            (k, max(i for i, m in enumerate(rows[k].response_mask) if m)) for k in (0, 1)]
    with pytest.raises(StepExpansionError, match="turn rewards.*traj.enable=false") as err:
        step_outputs(out, merge_prefix=False, turn_rewards=False)
    assert err.value.field == "reward"


def test_a_turn_reward_that_is_not_a_finite_number_is_refused():
    from verl_traj.stepwise.expand import StepExpansionError
    from verl_traj.testing import token_trajectory

    for bad in (float("nan"), "0.5", True):
        torch.manual_seed(0)
        records, prompt, response, mask, lps = token_trajectory(np.random.default_rng(1), 2)
        records[0]["reward"] = bad
        with pytest.raises(StepExpansionError, match="reward=") as err:
            from verl_traj.stepwise.expand import trajectory_step_rows

            trajectory_step_rows(prompt, response, mask, lps, records, merge_prefix=False)
        assert err.value.field == "reward"


def _with_old_log_probs(data):
    """The trainer's log-probs: the rollout's plus a function of the token (the same context in both layouts)."""
    td = data.batch
    td["old_log_probs"] = td["rollout_log_probs"] + 0.05 * ((td["responses"] % 7).float() - 3) * (td["response_mask"] != 0)
    return data


@pytest.mark.parametrize("rs", [None, "seq_mean_k1"])
def test_trajectory_ratios_give_step_rows_and_merged_rows_the_same_weights(rs):
    """Real expansion + planner (v0 adapter, ``fit_patches``' wrapper of verl's rollout correction): the same
    trajectories as unmerged step rows and as prefix-merged rows get the same trajectory IS weight and the same
    rejection on every loss token; padding rows keep their mask and get weight 0; ``traj_ratio/*`` is logged, each
    trajectory's weight the product of its rows' (``max_abs_row_gap`` 0)."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch as verl_add

    from verl_traj.integration.rows.stepwise_rows import trajectory_scoped_correction

    config = OmegaConf.create({"rollout_is": "sequence", "rollout_is_threshold": 50.0, "rollout_rs": rs,
                               "rollout_rs_threshold": "0.98_1.02" if rs else None})
    got, metrics = {}, {}
    for merge in (False, True):
        torch.manual_seed(0)  # the test trajectories draw their tokens from torch's generator
        data = _with_old_log_probs(planned_stepwise_batch(3, merge=merge)[0])
        pad_mask = data.batch["response_mask"][data.batch["is_padding"]].clone()
        before = {t: len(v) for t, v in _loss_token_credit(data, "response_mask").items()}
        data, metrics[merge] = trajectory_scoped_correction(verl_add)(data, config)
        after = {t: len(v) for t, v in _loss_token_credit(data, "response_mask").items()}
        assert all(after.get(t, 0) in (0, n) for t, n in before.items())  # a trajectory is kept or rejected whole
        got[merge] = (_loss_token_credit(data, "rollout_is_weights"), _loss_token_credit(data, "response_mask"))
        assert torch.equal(data.batch["response_mask"][data.batch["is_padding"]], pad_mask)
        assert torch.all(data.batch["rollout_is_weights"][data.batch["is_padding"]] == 0)
    for a, b in zip(got[False], got[True]):
        assert a.keys() == b.keys()
        for traj in a:
            assert a[traj] == pytest.approx(b[traj], rel=1e-5), traj
    weights = {t: set(round(w, 5) for w, m in zip(ws, got[False][1][t]) if m) for t, ws in got[False][0].items()}
    assert all(len(w) <= 1 for w in weights.values())  # one weight per trajectory, on all its kept tokens
    for merge in (False, True):
        assert metrics[merge]["traj_ratio/max_abs_row_gap"] < 1e-5
        assert metrics[merge]["traj_ratio/trajectories"] == 4
    if rs:  # the geometric-mean bounds reject some trajectory (whole, checked above), not all
        assert 0 < metrics[False]["traj_ratio/rejected_share"] < 1


def test_a_wrong_turn_reward_count_is_refused_as_a_contract_every_rollout_breaks():
    """Regression (issue 31 review): step_rewards of the wrong length raised a plain ValueError, so v1 dropped and
    refilled its groups for ever; now a StepExpansionError that stops training (core.rollout.failures.FATAL_TAG)."""
    from types import SimpleNamespace

    from verl_traj.core.rollout.failures import FATAL_TAG, failure_tag
    from verl_traj.stepwise.expand import StepExpansionError

    class Server:
        async def generate(self, request_id, *, prompt_ids, sampling_params, **kw):
            return SimpleNamespace(token_ids=[5], log_probs=[-0.1])

    class TwoCalls:
        def __init__(self):
            self.server_manager, self.response_length, self.config = Server(), 8, None

        async def run(self, sampling_params, **kwargs):
            await self.server_manager.generate("r", prompt_ids=[1], sampling_params={})
            await self.server_manager.generate("r", prompt_ids=[1, 5, 2], sampling_params={})
            return SimpleNamespace(prompt_ids=[1], extra_fields={})

    class OneRewardTooFew(sal.StepRecordingMixin, TwoCalls):
        def step_rewards(self, calls, output):
            return [0.1]

    with pytest.raises(StepExpansionError, match=r"step_rewards returned 1 rewards for 2 LLM calls. Fix") as err:
        asyncio.run(OneRewardTooFew().run({}))
    assert err.value.field == "step_rewards" and FATAL_TAG in failure_tag(0, err.value)
