"""Step-wise outcome advantages: per trajectory, broadcast on each row's own response mask."""

import numpy as np
import pytest
import torch

from verl.trainer.ppo.core_algos import get_adv_estimator_fn

from verl_traj.config import TrajConfig, TrajConfigError
from verl_traj.core.plan.estimators import ESTIMATORS, step_row_estimators
from verl_traj.integration.rows.credit import register_rules_with_verl
from verl_traj.integration.startup.verl_checks import validate_against_verl
from verl_traj.stepwise.advantages import (StepwiseAdvantageError, broadcast_step_advantages, check_stepwise_estimator,
                                           last_step_rows)

from tests.stepwise.helpers import traj_index_of, trajectory_advantages


def _right_padded_mask(lengths, width):
    return (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).float()


def _two_groups_batch():
    """Group "g0": traj A (3 steps, reward 1) and B (2 steps, reward 0); group "g1": C (1 step, r=1), D (2 steps,
    r=0.5).

    Responses are right-padded to width 8 with DIFFERENT lengths per step (prompts would be left-padded).
    Rows are deliberately interleaved (not grouped by trajectory).
    """
    rows = [
        # traj, uid, step, last, resp_len, reward_on_row
        ("A", "g0", 0, False, 5, 0.0),
        ("B", "g0", 0, False, 2, 0.0),
        ("A", "g0", 1, False, 3, 0.0),
        ("C", "g1", 0, True, 7, 1.0),
        ("B", "g0", 1, True, 6, 0.0),
        ("D", "g1", 0, False, 1, 0.0),
        ("A", "g0", 2, True, 4, 1.0),
        ("D", "g1", 1, True, 8, 0.5),
    ]
    width = 8
    lengths = [r[4] for r in rows]
    mask = _right_padded_mask(lengths, width)
    rewards = torch.zeros(len(rows), width)
    for b, r in enumerate(rows):
        if r[5]:
            rewards[b, r[4] - 1] = r[5]  # reward on the last response token of the last-step row
    traj = np.array([r[0] for r in rows], dtype=object)
    uid = np.array([r[1] for r in rows], dtype=object)
    last = np.array([r[3] for r in rows])
    return rows, rewards, mask, uid, traj, last


def test_skyrl_1492_regression_each_step_gets_advantage_on_its_own_tokens():
    rows, rewards, mask, uid, traj, last = _two_groups_batch()
    adv, ret, traj_adv, index = trajectory_advantages(
        rewards, mask, uid, traj, last, estimator_fn=get_adv_estimator_fn("grpo"), estimator_name="grpo"
    )
    # Per-trajectory GRPO: g0 = {A: 1, B: 0}, g1 = {C: 1, D: 0.5}; std is torch.std (unbiased).
    eps = 1e-6
    s = torch.tensor([1.0, 0.0]).std()
    expect_traj = {"A": 0.5 / (s + eps), "B": -0.5 / (s + eps)}
    s1 = torch.tensor([1.0, 0.5]).std()
    expect_traj.update({"C": 0.25 / (s1 + eps), "D": -0.25 / (s1 + eps)})
    for b, r in enumerate(rows):
        L = r[4]
        # the trajectory's advantage on EVERY one of the row's own response tokens ...
        assert torch.allclose(adv[b, :L], torch.full((L,), float(expect_traj[r[0]])), atol=1e-5), (b, adv[b])
        # ... and nothing on its padding
        assert torch.count_nonzero(adv[b, L:]) == 0
    # Earlier (non-last) steps of a rewarded trajectory are NOT zero (the bug: they were).
    assert torch.count_nonzero(adv[0]) == 5 and torch.count_nonzero(adv[2]) == 3
    assert torch.equal(ret, adv)  # outcome estimators: returns == advantages


def test_buggy_approach_would_differ():
    """Documents the bug: copying the last row's (mask-shaped) advantage to earlier rows misplaces it."""
    rows, rewards, mask, uid, traj, last = _two_groups_batch()
    adv, *_ = trajectory_advantages(
        rewards, mask, uid, traj, last, estimator_fn=get_adv_estimator_fn("grpo"), estimator_name="grpo"
    )
    last_row_of_A = 6
    buggy_row0 = adv[last_row_of_A]  # length-4 mask copied onto a length-5 response
    assert not torch.equal(buggy_row0, adv[0])
    assert torch.count_nonzero(buggy_row0[:5]) == 4  # token 4 of step 0 would get no advantage


def test_row_level_grpo_differs_from_trajectory_level():
    """Running GRPO over rows counts a 3-step trajectory 3 times in its group: different numbers."""
    rows, rewards, mask, uid, traj, last = _two_groups_batch()
    adv, *_ = trajectory_advantages(
        rewards, mask, uid, traj, last, estimator_fn=get_adv_estimator_fn("grpo"), estimator_name="grpo"
    )
    row_adv, _ = get_adv_estimator_fn("grpo")(token_level_rewards=rewards, response_mask=mask, index=uid)
    assert not torch.allclose(row_adv, adv)


@pytest.mark.parametrize("name", ["grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "gpg"])
def test_matches_estimator_on_one_row_per_trajectory(name):
    """Step-wise result == the estimator run on one (merged) row per trajectory, broadcast."""
    rows, rewards, mask, uid, traj, last = _two_groups_batch()
    fn = get_adv_estimator_fn(name)
    adv, _, traj_adv, index = trajectory_advantages(
        rewards, mask, uid, traj, last, estimator_fn=fn, estimator_name=name
    )
    # reference: one row per trajectory with its reward
    scores = torch.tensor([[1.0], [0.0], [1.0], [0.5]])  # A, B, C, D (first-appearance order)
    ref, _ = fn(token_level_rewards=scores, response_mask=torch.ones(4, 1), index=np.array(["g0", "g0", "g1", "g1"], dtype=object))
    assert torch.allclose(traj_adv, ref[:, 0], atol=1e-6)
    assert torch.allclose(adv, broadcast_step_advantages(traj_adv, index, mask))


def test_opo_uses_trajectory_loss_tokens():
    rows, rewards, mask, uid, traj, last = _two_groups_batch()
    fn = get_adv_estimator_fn("opo")
    _, _, traj_adv, _ = trajectory_advantages(rewards, mask, uid, traj, last, estimator_fn=fn, estimator_name="opo")
    # loss tokens: A = 5+3+4 = 12, B = 2+6 = 8 ; baseline g0 = (12*1 + 8*0) / 20 = 0.6
    assert torch.allclose(traj_adv[:2], torch.tensor([0.4, -0.6]), atol=1e-6)
    # C = 7, D = 1+8 = 9 ; baseline g1 = (7*1 + 9*0.5)/16
    b1 = (7 * 1 + 9 * 0.5) / 16
    assert torch.allclose(traj_adv[2:], torch.tensor([1 - b1, 0.5 - b1]), atol=1e-6)


def test_grpo_passk_and_remax():
    rows, rewards, mask, uid, traj, last = _two_groups_batch()
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"norm_adv_by_std_in_grpo": False})
    _, _, t, _ = trajectory_advantages(
        rewards, mask, uid, traj, last, estimator_fn=get_adv_estimator_fn("grpo_passk"), estimator_name="grpo_passk",
        estimator_kwargs={"config": cfg},
    )
    assert torch.allclose(t, torch.tensor([1.0, 0.0, 0.5, 0.0]))
    baselines = torch.full((len(rows),), 0.25)
    _, _, t, _ = trajectory_advantages(
        rewards, mask, uid, traj, last, estimator_fn=get_adv_estimator_fn("remax"), estimator_name="remax",
        reward_baselines=baselines,
    )
    assert torch.allclose(t, torch.tensor([0.75, -0.25, 0.75, 0.25]))


def test_reward_reduction_sum_vs_last_step():
    rows, rewards, mask, uid, traj, last = _two_groups_batch()
    rewards = rewards.clone()
    rewards[0, 0] = 10.0  # a non-last row of A carries reward (e.g. a per-row scorer)
    fn = get_adv_estimator_fn("rloo")
    _, _, t_last, _ = trajectory_advantages(rewards, mask, uid, traj, last, estimator_fn=fn, estimator_name="rloo")
    _, _, t_sum, _ = trajectory_advantages(
        rewards, mask, uid, traj, last, estimator_fn=fn, estimator_name="rloo", reward_reduction="sum"
    )
    assert torch.allclose(t_last[:2], torch.tensor([1.0, -1.0]))  # ignored
    assert torch.allclose(t_sum[:2], torch.tensor([11.0, -11.0]))


def test_padding_rows_get_zero_and_do_not_join_groups():
    rows, rewards, mask, uid, traj, last = _two_groups_batch()
    fn = get_adv_estimator_fn("grpo")
    ref, *_ = trajectory_advantages(rewards, mask, uid, traj, last, estimator_fn=fn, estimator_name="grpo")
    pad_mask = torch.zeros(2, mask.shape[1])
    pad_mask[:, 0] = 1.0  # even a non-zero mask on a padding row must get zero advantage
    rewards2 = torch.cat([rewards, torch.ones(2, mask.shape[1])])
    mask2 = torch.cat([mask, pad_mask])
    uid2 = np.concatenate([uid, np.array(["__verl_traj_pad__0", "g0"], dtype=object)])
    traj2 = np.concatenate([traj, np.array([None, "A"], dtype=object)])
    last2 = np.concatenate([last, [True, True]])
    is_pad = np.array([False] * len(rows) + [True, True])
    adv, _, t, index = trajectory_advantages(
        rewards2, mask2, uid2, traj2, last2, is_pad, estimator_fn=fn, estimator_name="grpo"
    )
    assert torch.allclose(adv[: len(rows)], ref)
    assert torch.count_nonzero(adv[len(rows) :]) == 0
    assert t.numel() == 4 and index[-2:].tolist() == [-1, -1]


@pytest.mark.parametrize("name", ["gae", "reinforce_plus_plus", "optimal_token_baseline", "gdpo"])
def test_estimators_without_a_per_trajectory_scalar_rejected(name):
    """The outcome path takes scalar-outcome estimators only: temporal ones run on the timeline
    (tests/stepwise/test_timeline.py), per-token baselines and gdpo not on step rows at all."""
    rows, rewards, mask, uid, traj, last = _two_groups_batch()
    with pytest.raises(StepwiseAdvantageError, match="traj.step_wise|timeline") as refused:
        trajectory_advantages(rewards, mask, uid, traj, last, estimator_fn=lambda **k: None, estimator_name=name)
    assert "set algorithm.adv_estimator" in str(refused.value) or "set traj.step_wise" in str(refused.value)


def test_unknown_estimator_needs_opt_in_and_scalar_output():
    with pytest.raises(StepwiseAdvantageError, match="allow_custom"):
        check_stepwise_estimator("my_est")
    assert check_stepwise_estimator("my_est", allow_custom=True) == "my_est"
    rows, rewards, mask, uid, traj, last = _two_groups_batch()

    def bad(token_level_rewards, response_mask, index, **kw):
        a = torch.zeros(token_level_rewards.shape[0], 3)
        return a, a

    with pytest.raises(StepwiseAdvantageError, match="scalar-outcome"):
        trajectory_advantages(
            rewards, mask, uid, traj, last, estimator_fn=bad, estimator_name="my_est", allow_custom=True
        )


def test_all_known_scalar_estimators_are_registered_in_verl():
    """verl's own, and the per-call credit rules (``gigpo``) once verl_traj registers them, as start-up does
    (regression: the test passed only after another test file had imported the integration package)."""
    register_rules_with_verl()  # start-up's registration, here on its own
    for name in step_row_estimators():
        assert callable(get_adv_estimator_fn(name))


def test_inconsistent_last_steps_raise():
    """The layout validates trajectories before planning; a batch changed afterwards is caught here."""
    rows, rewards, mask, uid, traj, last = _two_groups_batch()
    index = traj_index_of(traj)
    last_bad = last.copy()
    last_bad[0] = True  # A has two last steps
    with pytest.raises(StepwiseAdvantageError, match="is_last_step"):
        last_step_rows(index, last_bad)
    last_none = last.copy()
    last_none[3] = False  # C has none
    with pytest.raises(StepwiseAdvantageError, match="is_last_step"):
        last_step_rows(index, last_none)
    assert last_step_rows(index, last).tolist() == [6, 4, 3, 7]  # A, B, C, D


def test_integer_traj_ids_and_tensor_inputs():
    rows, rewards, mask, uid, traj, last = _two_groups_batch()
    tid = torch.tensor([{"A": 7, "B": 3, "C": 11, "D": 0}[t] for t in traj])
    adv1, *_ = trajectory_advantages(rewards, mask, uid, traj, last, estimator_fn=get_adv_estimator_fn("grpo"))
    adv2, *_ = trajectory_advantages(
        rewards, mask.bool(), uid, tid, torch.as_tensor(last), estimator_fn=get_adv_estimator_fn("grpo")
    )
    assert torch.allclose(adv1, adv2)


def test_every_verl_estimator_has_traits_and_startup_agrees_with_run_time():
    """One registry answers both questions: for every estimator verl registers, the start-up check
    (``validate_against_verl`` with ``traj.step_wise=true``) refuses it exactly when the step-wise advantage
    path would refuse it after the first rollout (``gdpo`` once passed the first and failed the second)."""
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY

    missing = sorted(set(ADV_ESTIMATOR_REGISTRY) - set(ESTIMATORS))
    assert not missing, f"verl registers estimators verl_traj has no traits for: {missing}"
    verl = {"data": {"max_prompt_length": 8, "max_response_length": 8}}
    for name in ADV_ESTIMATOR_REGISTRY:
        try:
            validate_against_verl(TrajConfig(step_wise=True), {**verl, "algorithm": {"adv_estimator": name}})
            startup_ok = True
        except TrajConfigError as e:
            assert f"algorithm.adv_estimator={name!r}" in str(e)
            startup_ok = False
        try:
            check_stepwise_estimator(name, allow_custom=True)
            runtime_ok = True
        except StepwiseAdvantageError:
            runtime_ok = False
        assert startup_ok == runtime_ok == (name in step_row_estimators()), name
    with pytest.raises(TrajConfigError, match="'gdpo'.*traj.step_wise"):
        validate_against_verl(TrajConfig(step_wise=True), {**verl, "algorithm": {"adv_estimator": "gdpo"}})
