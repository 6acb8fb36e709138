"""Trajectory-scoped rollout correction (``verl_traj.stepwise.ratios``) against verl's own
``compute_rollout_correction_and_rejection_mask`` on the concatenated trajectory, in fp32.

A trajectory of k turns: turn i's response tokens r_i are loss tokens, the observation tokens o_i after it are not.
As step rows, row i holds r_i (right-padded); as one merged row, r_1 o_1 r_2 ... r_k with o_i masked (their
log-probs arbitrary). verl's "sequence" quantities on the merged row are the trajectory's: with
``traj.ratio_scope=trajectory`` the step rows must get exactly those, on the same tokens."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask as verl_correction

from verl_traj.core.errors import TrajInputError
from verl_traj.stepwise.ratios import (check_ratio_groups, ratio_group_bound, stochastic_in_training,
                                       trajectory_ratio_metrics, trajectory_rollout_correction)
from verl_traj.stepwise.timeline import Timeline

MODES = [  # (rollout_is, rollout_rs, rollout_rs_threshold)
    ("sequence", None, None),
    ("token", None, None),
    ("sequence", "seq_sum_k3", "0.8"),
    (None, "seq_mean_k1", "0.9_1.1"),  # the geometric-mean ratio bounds
    ("sequence", "seq_max_k2,token_k1", "0.3,0.5_2.0"),
]


@st.composite
def trajectories(draw, max_trajs=4, max_turns=4):
    """[(response tokens, observation tokens) per turn] per trajectory, and a seed for the log-probs."""
    trajs = [[(draw(st.integers(1, 4)), draw(st.integers(0, 3))) for _ in range(draw(st.integers(1, max_turns)))]
             for _ in range(draw(st.integers(1, max_trajs)))]
    return trajs, draw(st.integers(0, 2**16))


def _layouts(trajs, seed):
    """Step rows and merged rows, each ``(traj, step, old_lp, rollout_lp, mask)``; a response token has the same
    log-probs in both layouts (the same context), observation tokens get garbage (masked)."""
    g = torch.Generator().manual_seed(seed)
    steps, merged = [], []
    for t, turns in enumerate(trajs):
        parts = []
        for i, (n_resp, n_obs) in enumerate(turns):
            old = -torch.rand(n_resp, generator=g) * 2
            roll = old + 0.3 * torch.randn(n_resp, generator=g)  # the rollout engine's log-probs differ a little
            steps.append((t, i, old, roll, torch.ones(n_resp)))
            parts.append((old, roll, torch.ones(n_resp)))
            if i < len(turns) - 1 and n_obs:
                parts.append((torch.randn(n_obs, generator=g), torch.randn(n_obs, generator=g), torch.zeros(n_obs)))
        merged.append((t, 0, *(torch.cat([p[j] for p in parts]) for j in range(3))))
    return steps, merged


def _batch(rows, padding_rows=0, order_seed=0):
    """``[B, R]`` old / rollout log-probs and masks of ``rows`` in a random order, plus padding rows of garbage."""
    width = max(len(r[2]) for r in rows)
    rows = [rows[i] for i in np.random.default_rng(order_seed).permutation(len(rows))]
    B = len(rows) + padding_rows
    old, roll, mask = torch.full((B, width), -5.0), torch.full((B, width), -1.0), torch.zeros(B, width)
    traj, step = torch.full((B,), -1, dtype=torch.long), torch.zeros(B, dtype=torch.long)
    for b, (t, i, o, r, m) in enumerate(rows):
        old[b, :len(o)], roll[b, :len(o)], mask[b, :len(o)], traj[b], step[b] = o, r, m, t, i
    return old, roll, mask, traj, step


def _per_loss_token(values, mask, traj, step):
    """{(trajectory, k-th loss token in time order): value}."""
    out, count = {}, {}
    for b in sorted(range(len(traj)), key=lambda b: (int(traj[b]), int(step[b]))):
        if traj[b] < 0:
            continue
        for j in torch.nonzero(mask[b]).reshape(-1).tolist():
            k = count.get(int(traj[b]), 0)
            count[int(traj[b])] = k + 1
            out[(int(traj[b]), k)] = float(values[b, j])
    return out


def _correct(rows, mode, padding_rows=0, order_seed=0):
    old, roll, mask, traj, step = _batch(rows, padding_rows, order_seed)
    rollout_is, rs, rs_threshold = mode
    got = trajectory_rollout_correction(verl_correction, Timeline.build(traj, step, mask), old, roll, mask,
                                        rollout_is=rollout_is, rollout_is_threshold=2.0, rollout_rs=rs,
                                        rollout_rs_threshold=rs_threshold)
    return got, old, roll, mask, traj, step


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(str(x) for x in m))
@settings(max_examples=25, deadline=None)
@given(batch=trajectories(), order_seed=st.integers(0, 100), padding_rows=st.integers(0, 2))
def test_step_rows_get_the_merged_rows_trajectory_weights_and_rejections(mode, batch, order_seed, padding_rows):
    """k step rows in any order, with padding rows == the merged row == verl on the concatenated trajectory: the
    same IS weight and the same kept mask on every loss token, the same per-trajectory metrics; padding rows 0."""
    steps, merged = _layouts(*batch)
    a, *rows_a = _correct(steps, mode, padding_rows, order_seed)
    b, *rows_b = _correct(merged, mode)
    old, roll, mask, traj, step = rows_b
    ref_w, ref_mask, ref_metrics = verl_correction(old, roll, mask, rollout_is=mode[0], rollout_is_threshold=2.0,
                                                   rollout_rs=mode[1], rollout_rs_threshold=mode[2])
    keep_a = _per_loss_token(a.response_mask, rows_a[2], rows_a[3], rows_a[4])
    assert keep_a == _per_loss_token(b.response_mask, mask, traj, step) == _per_loss_token(ref_mask, mask, traj, step)
    if mode[0] is not None:
        got = _per_loss_token(a.weights, rows_a[2], rows_a[3], rows_a[4])
        want = _per_loss_token(ref_w.batch["rollout_is_weights"], mask, traj, step)
        assert got.keys() == want.keys()
        for key in got:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    for key, value in ref_metrics.items():  # a std of equal fp32 weights is sqrt(rounding): ~1e-4, not 0
        assert a.metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-3 if key.endswith("std") else 1e-5), key
    pad = rows_a[3] < 0
    assert torch.all(a.response_mask[pad] == 0) and (a.weights is None or torch.all(a.weights[pad] == 0))


def test_a_trajectory_weight_is_the_product_of_its_rows_weights():
    """Worked example: a trajectory of three rows with log-ratio sums 0.1, -0.3 and 0.05 gets one IS weight,
    exp(-0.15) = 0.8607, on all its tokens (row scope would give exp(0.1), exp(-0.3), exp(0.05)); a one-row
    trajectory keeps its own; ``traj_ratio/max_abs_row_gap`` reads 0."""
    old = torch.zeros(4, 2)
    roll = -torch.tensor([[0.1, 0.0], [-0.2, -0.1], [0.05, 0.0], [0.4, 0.0]])  # log-ratio = old - roll
    mask = torch.tensor([[1, 0], [1, 1], [1, 0], [1, 0]], dtype=torch.float32)
    traj, step = torch.tensor([0, 0, 0, 1]), torch.tensor([0, 1, 2, 0])
    got = trajectory_rollout_correction(verl_correction, Timeline.build(traj, step, mask), old, roll, mask,
                                        rollout_is="sequence", rollout_is_threshold=5.0)
    w = got.weights
    assert w[:3][mask[:3] != 0].tolist() == pytest.approx([math.exp(-0.15)] * 4, rel=1e-6)
    assert w[3, 0].item() == pytest.approx(math.exp(0.4), rel=1e-6) and w[3, 1] == 0
    rows_sum = ((old - roll) * mask).sum(-1)
    metrics = trajectory_ratio_metrics(got, rows_sum, traj)
    assert metrics["traj_ratio/max_abs_row_gap"] < 1e-6 and metrics["traj_ratio/trajectories"] == 2
    assert metrics["traj_ratio/weight_min"] == pytest.approx(math.exp(-0.15), rel=1e-6)


def test_a_rejected_trajectory_loses_every_row_never_half():
    """seq_sum_k3 over the whole trajectory: one far-off row rejects all three rows of its trajectory (row scope
    would drop that row and train the others); the other trajectory is kept; ``traj_ratio/rejected_share`` 1/2."""
    old = torch.zeros(4, 2)
    roll = torch.tensor([[0.0, 0.0], [-3.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]], dtype=torch.float32)
    traj, step = torch.tensor([0, 0, 0, 1]), torch.tensor([0, 1, 2, 0])
    got = trajectory_rollout_correction(verl_correction, Timeline.build(traj, step, mask), old, roll, mask,
                                        rollout_is=None, rollout_rs="seq_sum_k3", rollout_rs_threshold="1.0")
    assert got.response_mask[:3].sum() == 0 and torch.equal(got.response_mask[3], mask[3])
    assert got.kept.tolist() == [False, True]
    metrics = trajectory_ratio_metrics(got, ((old - roll) * mask).sum(-1), traj)
    assert metrics["traj_ratio/rejected_share"] == 0.5


# ---- GSPO's sequence ratio over the trajectory (computed from the current policy inside the actor's loss) --------


@settings(max_examples=40, deadline=None)
@given(batch=trajectories(), split=st.integers(0, 3), padding_rows=st.integers(0, 2))
def test_the_shift_gives_every_row_its_trajectorys_mean_log_ratio(batch, split, padding_rows):
    """After the shift, each row's mean log-ratio (what verl's GSPO loss computes per row) is its trajectory's mean
    over all its rows, whatever subset of rows each of several workers holds (their sums add up: the all-reduce);
    padding rows (group -1) are not shifted."""
    from verl_traj.stepwise.ratios import group_log_ratio_sums, sequence_ratio_shift

    steps, _ = _layouts(*batch)
    old, roll, mask, traj, _ = _batch(steps, padding_rows)
    lp = roll  # any "current policy" log-probs
    T = int(traj.max()) + 1
    parts = [torch.arange(len(traj)) % (split + 1) == k for k in range(split + 1)]  # rows held by each worker
    sums = sum(group_log_ratio_sums(lp[p], old[p], mask[p], traj[p], T) for p in parts)
    shift = sequence_ratio_shift(lp, old, mask, traj, sums)
    shifted = ((lp - old - shift[:, None]) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    want = {t: float(((lp - old) * mask)[traj == t].sum() / mask[traj == t].sum()) for t in range(T)}
    for b in range(len(traj)):
        if traj[b] >= 0 and mask[b].sum() > 0:
            assert float(shifted[b]) == pytest.approx(want[int(traj[b])], rel=1e-5, abs=1e-6)
    assert torch.all(shift[traj < 0] == 0)


def _gspo_config():
    from verl.workers.config import ActorConfig, PolicyLossConfig

    return ActorConfig(strategy="fsdp2", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                       clip_ratio=0.2, entropy_coeff=0.0, use_kl_loss=False, loss_agg_mode="token-mean",
                       policy_loss=PolicyLossConfig(loss_mode="gspo"))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_on_shifted_step_rows_is_gspo_on_the_merged_row(seed, monkeypatch):
    """verl's GSPO loss (through verl_traj's weighted policy loss, one global weight per token) on three
    trajectories as step rows with the shift == on the same trajectories as merged rows: the same loss and the same
    gradient on every loss token's log-prob (fp32); without the shift (row scope) it differs."""
    from tests.integration import grad_harness as H
    from verl_traj.integration.workers.losses import weighted_policy_loss
    from verl_traj.stepwise.ratios import group_log_ratio_sums, sequence_ratio_shift

    H.patch_verl_device(monkeypatch)
    steps, merged = _layouts([[(3, 2), (2, 1), (4, 0)], [(2, 0), (3, 0)], [(5, 0)]], seed)
    results = {}
    for name, rows in (("steps", steps), ("merged", merged), ("row scope", steps)):
        old, cur, mask, traj, step = _batch(rows)
        cur = (old + 0.4 * (cur - old)).clone().requires_grad_(True)  # ratios around the clip range
        adv = torch.tensor([1.0, -0.5, 0.3])[traj.clamp(min=0)][:, None].expand_as(mask)
        shift = None
        if name == "steps":
            shift = sequence_ratio_shift(cur.detach(), old, mask, traj,
                                         group_log_ratio_sums(cur.detach(), old, mask, traj, 3))
        weight = torch.full((len(traj),), 1.0 / float(mask.sum()))  # token-mean over the whole batch
        loss, _ = weighted_policy_loss(_gspo_config(), log_prob=cur, old_log_prob=old, advantages=adv,
                                       response_mask=mask, loss_weight=weight, dp_size=1, seq_ratio_shift=shift)
        loss.backward()
        results[name] = (float(loss.detach()), _per_loss_token(cur.grad, mask, traj, step))
    assert results["steps"][0] == pytest.approx(results["merged"][0], rel=1e-5)
    for key, grad in results["merged"][1].items():
        assert results["steps"][1][key] == pytest.approx(grad, rel=1e-4, abs=1e-7), key
    assert results["row scope"][1] != pytest.approx(results["merged"][1], rel=1e-3)


class _Configured(torch.nn.Module):
    """A module with an HF-style config (``to_dict``) and no dropout layer."""

    def __init__(self, **config) -> None:
        super().__init__()
        self.config = type("Config", (), {"to_dict": lambda _self: dict(config)})()
        self.proj = torch.nn.Linear(2, 2)


@pytest.mark.parametrize("module, stochastic", [
    (torch.nn.Linear(2, 2), False),
    (torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0)), False),
    (torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1)), True),
    (_Configured(attention_dropout=0.0, hidden_size=8), False),
    (_Configured(attention_dropout=0.1), True),  # HF attention applies it functionally: no Dropout layer
    (_Configured(router_jitter_noise=0.01), True),
    (None, True),  # unknown: assume it draws, so the GSPO pre-pass runs
])
def test_a_training_forward_is_stochastic_exactly_when_something_draws_random_numbers(module, stochastic):
    assert stochastic_in_training(module) is stochastic


def test_the_pre_pass_table_bound_covers_every_row_and_out_of_range_groups_are_refused_by_row():
    assert ratio_group_bound(6, 2) == 12 and ratio_group_bound(0, 4) == 1
    check_ratio_groups(torch.tensor([0, 11, -1, 3]), 12)
    with pytest.raises(TrajInputError) as err:
        check_ratio_groups(torch.tensor([0, 12, -1]), 12)
    assert err.value.field == "ratio_group[1]"
