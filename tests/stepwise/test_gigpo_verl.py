"""``algorithm.adv_estimator=gigpo`` through verl_traj's adapters: v0's trainer expands and plans the step rows
(``_balance_batch``) and its ``compute_advantage`` patch computes GiGPO, equal to the paper's equations; v1's
agent-loop worker tags each row with its calls' anchor keys, the same keys v0's expansion writes; start-up refuses
GiGPO without step rows and its knobs without GiGPO, naming the field and the fix."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput
from verl.trainer.ppo import ray_trainer

from verl_traj.config import TrajConfig, TrajConfigError
from verl_traj.core.keys import ADVANTAGE_METRICS, STEP_ANCHORS
from verl_traj.core.rollout.row_tags import anchor_entries
from verl_traj.integration.agent_loops.v1_agent_loop import step_outputs
from verl_traj.integration.patches.scoped import fit_patches, patched
from verl_traj.stepwise.expand import expand_step_rows
from verl_traj.stepwise.step_groups import StepGroupOptions
from verl_traj.testing import step_record_batch, token_trajectory
from omegaconf import OmegaConf

from tests.integration.test_v1_adapter import _v1_view
from verl_traj.core.rollout.row_key import parse_row_keys
from verl_traj.core.rollout.row_tags import anchor_tag
from verl_traj.integration.rows.stepwise_rows import stepwise_advantage
from verl_traj.integration.trainers.v1_advantage import planned_advantage
from verl_traj.testing.batches import as_dataproto

from .test_step_groups import reference
from .verl_batches import planned_gigpo_batch


@pytest.mark.parametrize("merge", [False, True])
def test_v0_trains_gigpo_on_its_planned_step_rows_as_the_papers_equations(merge):
    """The v0 trainer's own path: ``_balance_batch`` expands (anchor keys included), plans and pads for dp=2, then
    fit's ``compute_advantage`` (the step-wise adapter under the real-rows wrapper) computes GiGPO; calls of a group
    meet the same observations, so the step-level term is in play."""
    data, trajs, uids, outcomes = planned_gigpo_batch(7, merge)
    assert STEP_ANCHORS in data.batch.keys()
    options = StepGroupOptions(weight=0.7, baseline="gigpo")
    with patched(fit_patches(True, step_groups=options)):
        ray_trainer.compute_advantage(data, "gigpo", gamma=0.9, norm_adv_by_std_in_grpo=True)
    ref = reference([t[0] for t in trajs], uids, outcomes, gamma=0.9, weight=0.7, baseline="gigpo", norm=True)
    adv, mask = data.batch["advantages"], data.batch["response_mask"]
    for b in range(adv.shape[0]):
        if data.batch["traj_index"][b] < 0:
            assert not adv[b].any()
            continue
        t = int(str(data.non_tensor_batch["traj_id"][b])[1:])
        k = int(data.non_tensor_batch["step_index"][b])
        steps = range(len(trajs[t][0])) if merge else [k]  # merged: the trajectory's calls in one row
        lens = [len(trajs[t][0][j]["response_ids"]) for j in steps]
        for j, chunk in zip(steps, adv[b][mask[b] != 0].split(lens)):
            torch.testing.assert_close(chunk, torch.full_like(chunk, ref[(t, j)]), rtol=1e-5, atol=1e-5)
    assert STEP_ANCHORS not in data.batch.keys()  # read once, not sent to the update
    metrics = data.meta_info[ADVANTAGE_METRICS]
    # more calls in shared groups than the six first calls behind the two prompts (6 of 21 calls)
    assert metrics["traj_gigpo/steps_in_shared_groups"] > 0.3 and metrics["traj_gigpo/step_adv_share"] > 0.05


@pytest.mark.parametrize("merge", [False, True])
def test_v1_planned_advantage_gives_v0s_gigpo(merge):
    """v1: the rows' anchor tags, decoded by the plan's facts, and the trajectory's reward copied onto every step row
    (v1's convention, counted once) give exactly v0's GiGPO advantages; the metrics reach the plan's facts."""
    data, *_ = planned_gigpo_batch(5, merge)
    keys, scores, facts = _v1_view(data)
    facts = dataclasses.replace(facts, step_anchors=anchor_entries([anchor_tag(r) for r in data.batch[STEP_ANCHORS]]))
    tensors = {"token_level_scores": scores, "token_level_rewards": scores.clone(),
               "response_mask": data.batch["response_mask"], "attention_mask": data.batch["attention_mask"]}
    options, handed = StepGroupOptions(weight=1.0, baseline="leave_one_out"), []
    got = planned_advantage(facts, as_dataproto(tensors, {"uid": parse_row_keys(keys).uid}), keys, "gigpo",
                            gamma=0.95, config=OmegaConf.create({}), step_groups=options,
                            hand_on=handed.append).batch["advantages"]
    expected = stepwise_advantage(ray_trainer.compute_advantage, step_groups=options)(data, "gigpo", gamma=0.95,
                                                                                       config=OmegaConf.create({}))
    torch.testing.assert_close(got, expected.batch["advantages"])
    assert handed[0].advantage_metrics["traj_gigpo/steps_in_shared_groups"] > 0


def test_gigpo_without_the_traj_knobs_wired_is_an_error_not_a_default():
    data, *_ = planned_gigpo_batch(1)
    with patched(fit_patches(True)), pytest.raises(RuntimeError, match="StepGroupOptions"):
        ray_trainer.compute_advantage(data, "gigpo")


@pytest.mark.parametrize("merge", [False, True])
def test_v1_row_tags_carry_the_anchor_keys_v0s_expansion_writes(merge):
    rng = np.random.default_rng(3)
    torch.manual_seed(3)
    trajs = [token_trajectory(rng, 4, break_at=2, prompt=torch.tensor([5, 6, 7]), obs_vocab=2) for _ in range(3)]
    tensors, non = step_record_batch(trajs, ["g"] * 3, [1.0, 0.0, 0.5], R=80)
    v0 = expand_step_rows(tensors, non, merge_prefix=merge, step_anchors=True).tensors[STEP_ANCHORS]
    rows = []
    for records, prompt, response, mask, lp in trajs:
        out = AgentLoopOutput(prompt_ids=prompt.tolist(), response_ids=response.tolist(), response_mask=mask.tolist(),
                              response_logprobs=lp.tolist(), num_turns=9, metrics={},
                              extra_fields={"traj_steps": {"steps": records}})
        rows += step_outputs(out, merge, anchors=True)[1]
    row, pos, key = anchor_entries(rows)
    dense = torch.zeros_like(v0).index_put_((row, pos), key)
    assert torch.equal(dense, v0) and len(torch.unique(key)) < key.numel()  # some calls share an observation


@pytest.mark.parametrize("overrides, field", [
    (["algorithm.adv_estimator=gigpo"], "algorithm.adv_estimator"),  # the preset trains whole trajectories
    (["algorithm.adv_estimator=gigpo", "traj.step_wise=true", "traj.enable=false"], "algorithm.adv_estimator"),
    (["traj.step_advantage_weight=0.5"], "traj.step_advantage_weight"),  # a GiGPO knob without GiGPO
    (["traj.step_group_baseline=leave_one_out"], "traj.step_group_baseline"),
])
def test_start_up_refuses_gigpo_without_step_rows_and_its_knobs_without_gigpo(overrides, field):
    from verl_traj.integration.startup.checks import check_adv_estimator
    from verl_traj.testing.engine import cpu_config

    with pytest.raises(TrajConfigError) as err:
        check_adv_estimator(cpu_config(overrides))
    assert err.value.field == field and "Fix:" in str(err.value)


@pytest.mark.parametrize("knob, value", [("step_advantage_weight", -1.0), ("step_advantage_weight", float("nan")),
                                         ("step_group_baseline", "loo")])
def test_bad_gigpo_knobs_are_refused_naming_the_field(knob, value):
    with pytest.raises(TrajConfigError) as err:
        TrajConfig(**{knob: value})
    assert err.value.field == f"traj.{knob}"
