"""Temporal estimators across a trajectory's step rows (``verl_traj.stepwise.timeline``), against verl's own
estimators on the concatenated trajectory, in fp32 (the exact properties of the credit-across-turns issue).

A trajectory of k turns: turn i generates response tokens r_i (loss tokens), then the environment answers with
observation tokens o_i (in the next turn's prompt). As step rows, row i's response is r_i (right-padded to R); as one
prefix-merged row, the response is r_1 o_1 r_2 o_2 ... r_k with o_i masked. The value and reward of a response token
are the same in both layouts (the same context), observation tokens carry arbitrary values (masked)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

from verl.trainer.ppo.core_algos import get_adv_estimator_fn

from verl_traj.stepwise.timeline import Timeline, timeline_advantages


def _trajectories(draw, max_trajs=4, max_turns=4):
    trajs = []
    for _ in range(draw(st.integers(1, max_trajs))):
        turns = []
        for _ in range(draw(st.integers(1, max_turns))):
            turns.append((draw(st.integers(1, 5)), draw(st.integers(0, 3))))  # (response tokens, observation tokens)
        trajs.append(turns)
    return trajs


@st.composite
def batches(draw):
    trajs = _trajectories(draw)
    seed = draw(st.integers(0, 2**16))
    # verl's masked_whiten needs two loss tokens in the batch (its unbiased variance)
    assume(sum(n for turns in trajs for n, _ in turns) >= 2)
    return trajs, seed


def _layouts(trajs, seed):
    """Step rows and merged rows of the same trajectories, with per-response-token values and rewards."""
    g = torch.Generator().manual_seed(seed)
    steps, merged = [], []  # (traj, step, rewards, values, mask)
    for t, turns in enumerate(trajs):
        m_r, m_v, m_m = [], [], []
        for i, (n_resp, n_obs) in enumerate(turns):
            r = torch.zeros(n_resp)
            if i == len(turns) - 1:
                r[-1] = torch.rand((), generator=g)  # the outcome on the last token
            elif torch.rand((), generator=g) < 0.5:
                r[-1] = 0.1 * torch.rand((), generator=g)  # a turn reward on a step's last token
            v = torch.randn(n_resp, generator=g)
            steps.append((t, i, r, v, torch.ones(n_resp)))
            m_r += [r]
            m_v += [v]
            m_m += [torch.ones(n_resp)]
            if i < len(turns) - 1 and n_obs:
                m_r += [torch.zeros(n_obs)]
                m_v += [torch.randn(n_obs, generator=g)]  # masked: must not matter
                m_m += [torch.zeros(n_obs)]
        merged.append((t, 0, torch.cat(m_r), torch.cat(m_v), torch.cat(m_m)))
    return steps, merged


def _pad(rows, extra_padding_rows=0, order_seed=0):
    width = max(len(r[2]) for r in rows)
    perm = np.random.default_rng(order_seed).permutation(len(rows))  # rows in any order (the plan's)
    rows = [rows[i] for i in perm]
    B = len(rows) + extra_padding_rows
    out = {k: torch.zeros(B, width) for k in ("rewards", "values", "mask")}
    traj = torch.full((B,), -1, dtype=torch.long)
    step = torch.zeros(B, dtype=torch.long)
    for b, (t, i, r, v, m) in enumerate(rows):
        n = len(r)
        out["rewards"][b, :n], out["values"][b, :n], out["mask"][b, :n] = r, v, m
        traj[b], step[b] = t, i
    for b in range(len(rows), B):  # padding rows: garbage that must change nothing
        out["values"][b] = 7.0
        out["rewards"][b] = 3.0
    return out, traj, step


def _loss_tokens(out, traj, step):
    """{(trajectory, k-th loss token): (advantage, return)} in time order."""
    res = {}
    order = sorted(range(len(traj)), key=lambda b: (int(traj[b]), int(step[b])))
    count = {}
    for b in order:
        if traj[b] < 0:
            continue
        for j in torch.nonzero(out["mask"][b]).reshape(-1).tolist():
            k = count.get(int(traj[b]), 0)
            count[int(traj[b])] = k + 1
            res[(int(traj[b]), k)] = (out["adv"][b, j].item(), out["ret"][b, j].item())
    return res


def _run(name, rows, extra_padding_rows=0, order_seed=0, gamma=0.9, lam=0.8):
    from omegaconf import OmegaConf

    out, traj, step = _pad(rows, extra_padding_rows, order_seed)
    timeline = Timeline.build(traj, step, out["mask"])
    kwargs = {"gamma": gamma, "lam": lam} if name == "gae" else {"config": OmegaConf.create({"gamma": gamma})}
    adv, ret = timeline_advantages(get_adv_estimator_fn(name), timeline, out["rewards"], out["mask"],
                                   values=out["values"] if name == "gae" else None, estimator_kwargs=kwargs)
    out.update(adv=adv, ret=ret)
    return out, traj, step


@pytest.mark.parametrize("name", ["gae", "reinforce_plus_plus"])
@settings(max_examples=40, deadline=None)
@given(batch=batches(), order_seed=st.integers(0, 100), pad_rows=st.integers(0, 2))
def test_step_rows_and_merged_rows_get_the_same_credit(name, batch, order_seed, pad_rows):
    trajs, seed = batch
    steps, merged = _layouts(trajs, seed)
    a = _run(name, steps, pad_rows, order_seed)
    b = _run(name, merged)
    got, want = _loss_tokens(*a), _loss_tokens(*b)
    assert got.keys() == want.keys()
    for key in got:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-5), key
    out, traj, _ = a
    pad = traj < 0
    assert torch.all(out["adv"][pad] == 0) and torch.all(out["ret"][pad] == 0)  # padding rows: zeros


def test_the_merged_row_is_verls_own_estimator_on_the_concatenated_trajectory():
    """One trajectory as one row: on its loss tokens the result is verl's estimator on that row."""
    steps, merged = _layouts([[(3, 2), (2, 1), (4, 0)], [(2, 0)]], seed=3)
    out, traj, step = _run("gae", merged)
    R = out["mask"].shape[1]
    ref_adv, ref_ret = get_adv_estimator_fn("gae")(token_level_rewards=out["rewards"], values=out["values"],
                                                   response_mask=out["mask"], gamma=0.9, lam=0.8)
    loss = out["mask"] != 0  # the timeline holds loss tokens only (verl leaves carried values on masked positions)
    torch.testing.assert_close(out["adv"][loss], ref_adv[loss], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out["ret"][loss], ref_ret[loss], rtol=1e-6, atol=1e-6)
    assert R == max(len(r[2]) for r in merged)


def test_the_next_turns_value_bootstraps_the_last_token_of_a_turn():
    """Worked example, gamma = lam = 1, one trajectory of two one-token turns, no reward before the outcome 1.0:
    as separate rows GAE would give turn 1 the return 0 (its row ends there); on the timeline its return is the
    outcome 1.0 (through turn 2), and its advantage the TD error against turn 2's value."""
    rows = [(0, 0, torch.tensor([0.0]), torch.tensor([0.5]), torch.ones(1)),
            (0, 1, torch.tensor([1.0]), torch.tensor([0.25]), torch.ones(1))]
    out, traj, step = _pad(rows)
    timeline = Timeline.build(traj, step, out["mask"])
    adv, ret = timeline_advantages(get_adv_estimator_fn("gae"), timeline, out["rewards"], out["mask"],
                                   values=out["values"], estimator_kwargs={"gamma": 1.0, "lam": 1.0})
    first = int(torch.nonzero(step == 0)[0])
    assert ret[first].item() == pytest.approx(1.0)  # 0 + 1.0 through the next turn
    raw = torch.tensor([1.0 - 0.5, 1.0 - 0.25])  # returns minus values, before verl's whitening
    whitened = (raw - raw.mean()) / (raw.var() + 1e-8).sqrt()
    assert adv[first].item() == pytest.approx(whitened[0].item(), rel=1e-5)
