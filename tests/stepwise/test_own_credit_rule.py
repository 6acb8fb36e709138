"""A per-call credit rule of one's own, in this one file: one function and one ``register_credit_rule`` line make
``algorithm.adv_estimator=decayed_outcome`` valid on step rows. It is planned, advantaged and trained like GiGPO:
v0's ``_balance_batch`` and ``compute_advantage`` path (against a reference over Python lists), v1's
``planned_advantage`` (equal to v0's), start-up's checks, and ``python -m verl_traj.main_ppo`` with
``traj.credit_rule_modules=[tests.stepwise.test_own_credit_rule]`` (the module loaded in the driver, the trainer and
every agent-loop worker)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl.trainer.ppo import core_algos, ray_trainer

from verl_traj.config import TrajConfig, TrajConfigError
from verl_traj.core.errors import TrajInputError
from verl_traj.core.keys import ADVANTAGE_METRICS, STEP_ANCHORS
from verl_traj.core.rollout.row_key import parse_row_keys
from verl_traj.integration.patches.scoped import fit_patches, patched
from verl_traj.integration.rows.credit import load_rules
from verl_traj.integration.rows.stepwise_rows import stepwise_advantage
from verl_traj.integration.startup.checks import check_adv_estimator
from verl_traj.integration.trainers.v1_advantage import planned_advantage
from verl_traj.core.plan.estimators import ESTIMATORS
from verl_traj.stepwise.credit_rules import CREDIT_RULES, CallCredit, CreditResult, credit_rule, register_credit_rule
from verl_traj.stepwise.step_groups import StepGroupOptions
from verl_traj.testing.batches import as_dataproto

from tests.integration.test_v1_adapter import _v1_view

from .test_step_groups import reference
from .verl_batches import gigpo_dataproto, stepwise_trainer

RULE = "decayed_outcome"


@register_credit_rule(RULE)
def decayed_outcome(calls: CallCredit) -> CreditResult:
    """GRPO over trajectories, each call's share decayed by ``gamma`` per call after it:
    ``A(i, t) = A_E(i) * gamma ** (last_i - t)``, ``t`` a row's (first) call, ``last_i`` trajectory ``i``'s last."""
    real = calls.traj_index >= 0
    index = calls.traj_index.clamp(min=0)
    scores = torch.zeros(len(calls.traj_uid)).index_add_(0, index[real], calls.rewards[real].sum(-1).float())
    steps = torch.as_tensor(np.asarray(calls.steps, dtype=np.int64))
    last = torch.zeros(len(calls.traj_uid), dtype=torch.long).scatter_reduce(0, index[real], steps[real], "amax")
    decay = torch.where(real, calls.gamma ** (last[index] - steps).float(), torch.zeros(()))
    advantages = (calls.episode_fn(scores, calls.traj_uid)[index] * decay)[:, None] * calls.response_mask
    return CreditResult(advantages, metrics={f"traj_{RULE}/decay_mean": float(decay[real].mean())})


def _planned(seed: int, merge: bool):
    """The v0 trainer's ``_balance_batch`` on two ranks for ``adv_estimator=decayed_outcome``, with rewards."""
    data, trajs, uids, outcomes = gigpo_dataproto(seed)
    stepwise_trainer(TrajConfig(step_wise=True, merge_prefix=merge), 2, RULE)._balance_batch(data, {})
    data.batch["token_level_rewards"] = data.batch["rm_scores"].clone()
    return data, [t[0] for t in trajs], uids, outcomes


def test_v0_plans_and_advantages_the_rule_as_its_reference():
    """Registered in this file, the rule runs on v0's planned step rows (padding rows included) through fit's
    ``compute_advantage``: every loss token of call ``k`` of trajectory ``t`` gets ``A_E(t) * 0.9 ** (n_t - 1 - k)``;
    the rows carry no anchor keys (the rule does not read them) and its metric reaches ``meta_info``."""
    data, trajs, uids, outcomes = _planned(3, merge=False)
    assert STEP_ANCHORS not in data.batch.keys() and credit_rule(RULE).fn is decayed_outcome
    with patched(fit_patches(True, step_groups=StepGroupOptions(weight=1.0, baseline="gigpo"))):
        ray_trainer.compute_advantage(data, RULE, gamma=0.9, norm_adv_by_std_in_grpo=True)
    a_e = reference(trajs, uids, outcomes, gamma=0.9, weight=0.0, baseline="gigpo", norm=True)
    adv, mask, traj_index = data.batch["advantages"], data.batch["response_mask"], data.batch["traj_index"]
    assert not adv[traj_index < 0].any() and (traj_index < 0).any()  # padding rows: planned for two ranks
    for b in torch.nonzero(traj_index >= 0).flatten().tolist():
        t, k = int(str(data.non_tensor_batch["traj_id"][b])[1:]), int(data.non_tensor_batch["step_index"][b])
        expected = a_e[(t, k)] * 0.9 ** (len(trajs[t]) - 1 - k)
        torch.testing.assert_close(adv[b][mask[b] != 0], torch.full((int(mask[b].sum()),), expected), rtol=1e-5,
                                   atol=1e-5)
        assert not adv[b][mask[b] == 0].any()
    assert 0 < data.meta_info[ADVANTAGE_METRICS][f"traj_{RULE}/decay_mean"] < 1


@pytest.mark.parametrize("merge", [False, True])
def test_v1_planned_advantage_gives_v0s(merge):
    """v1's ``planned_advantage`` (the plan's facts, the trajectory's reward on every step row) gives v0's advantages."""
    data, *_ = _planned(5, merge)
    keys, scores, facts = _v1_view(data)
    tensors = {"token_level_scores": scores, "token_level_rewards": scores.clone(),
               "response_mask": data.batch["response_mask"], "attention_mask": data.batch["attention_mask"]}
    options, handed = StepGroupOptions(weight=1.0, baseline="gigpo"), []
    got = planned_advantage(facts, as_dataproto(tensors, {"uid": parse_row_keys(keys).uid}), keys, RULE,
                            gamma=0.95, config=OmegaConf.create({}), step_groups=options,
                            hand_on=handed.append).batch["advantages"]
    expected = stepwise_advantage(ray_trainer.compute_advantage, step_groups=options)(data, RULE, gamma=0.95,
                                                                                       config=OmegaConf.create({}))
    torch.testing.assert_close(got, expected.batch["advantages"])


def _config(**traj):
    return OmegaConf.create({"algorithm": {"adv_estimator": RULE}, "traj": traj})


def test_start_up_accepts_the_rule_on_step_rows_and_refuses_it_elsewhere():
    """Start-up: the name is an estimator verl knows on step rows; without step rows, with a knob only GiGPO reads, or
    with a rule module that cannot be imported, it refuses naming the field and the fix; verl's own path refuses it."""
    check_adv_estimator(_config(step_wise=True))
    with pytest.raises(TrajConfigError, match=r"traj.step_wise=true.*algorithm.adv_estimator=grpo"):
        check_adv_estimator(_config())
    with pytest.raises(TrajConfigError, match=r"read only by the credit rules \['gigpo'\]") as exc:
        check_adv_estimator(_config(step_wise=True, step_advantage_weight=0.5))
    assert exc.value.field == "traj.step_advantage_weight"
    with pytest.raises(TrajInputError, match="traj.credit_rule_modules names 'no_such.rules'") as exc:
        load_rules(["no_such.rules"])
    assert exc.value.field == "traj.credit_rule_modules"
    with pytest.raises(TrajConfigError, match="list of module names"):
        TrajConfig(credit_rule_modules="tests.stepwise.test_own_credit_rule")
    with pytest.raises(TrajInputError, match="reached verl's own advantage path"):
        core_algos.get_adv_estimator_fn(RULE)(token_level_rewards=None, response_mask=None, index=None)
    with pytest.raises(TrajInputError, match="already registered"):
        register_credit_rule(RULE)(lambda calls: calls)
    register_credit_rule("wrong_shape")(lambda c: CreditResult(c.response_mask[:, :1].float()))
    try:
        with pytest.raises(TrajInputError, match=r"advantages of shape \(\d+, 1\), expected"):
            with patched(fit_patches(True, step_groups=StepGroupOptions(weight=1.0, baseline="gigpo"))):
                ray_trainer.compute_advantage(_planned(0, False)[0], "wrong_shape", gamma=1.0)
    finally:  # a rule of this test only
        del CREDIT_RULES["wrong_shape"], ESTIMATORS["wrong_shape"]
        core_algos.ADV_ESTIMATOR_REGISTRY.pop("wrong_shape", None)  # the trainer put it in verl's registry


@pytest.mark.e2e
def test_the_rule_trains_through_main_ppo(tool_home, tmp_path, monkeypatch):
    """``python -m verl_traj.main_ppo`` on v1 (unmerged step rows: one row per LLM call) with the rule loaded by
    ``traj.credit_rule_modules``: the driver's start-up, the trainer and the agent-loop workers import it; its metric
    is on every step, and the policy updates on its advantages."""
    from tests.e2e.runs import run_stepwise

    root = str(Path(__file__).resolve().parents[2])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    metrics, out = run_stepwise(tool_home, tmp_path, "v1", False, steps=2, extra=(
        f"algorithm.adv_estimator={RULE}", "algorithm.gamma=0.9", "traj.credit_rule_modules=[tests.stepwise."
        "test_own_credit_rule]"))
    for m in metrics:
        assert 0 < m[f"traj_{RULE}/decay_mean"] <= 1, out[-3000:]
        assert m["actor/pg_loss"] == m["actor/pg_loss"] and m["traj_stepwise/rows_before"] > 0
