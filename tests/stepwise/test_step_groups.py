"""GiGPO's step groups (``verl_traj.stepwise.step_groups``) against a brute-force reference written from the paper's
equations (arXiv 2505.10978, eqs. for A^E, the discounted step return and A^S), on step rows built as production
builds them (step records -> ``expand_step_rows``), unmerged and prefix-merged, shuffled, with padding rows.

The reference knows nothing of hashes, spans or tensors: anchor states are the observation token tuples (what a call
saw after the longest common prefix with the previous call's context), groups are Python dicts."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from verl.trainer.ppo.core_algos import get_adv_estimator_fn

from verl_traj.core.errors import TrajInputError
from verl_traj.stepwise.advantages import run_outcome_estimator
from verl_traj.stepwise.expand import expand_step_rows
from verl_traj.core.keys import STEP_ANCHORS, TURN_REWARDS
from verl_traj.stepwise.step_groups import (StepCalls, discounted_step_returns, gigpo_advantages,
                                            step_group_advantages)
from verl_traj.testing import step_record_batch, token_trajectory
from verl_traj.testing.stopping_game import baseline_estimates, estimate_cells, stopping_game

from .helpers import traj_index_of

REWARDS = (0.0, 0.25, 0.5, 1.0)  # exact in float32: ties (zero-std groups) happen


def _common(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def reference(trajs, uids, outcomes, *, gamma, weight, baseline, norm, eps=1e-6):
    """``{(t, k): advantage}`` of every call, from the paper's equations over Python lists."""
    calls = {}  # (t, k) -> [observation, reward]
    for t, recs in enumerate(trajs):
        prev = None
        for k, rec in enumerate(recs):
            p = list(rec["prompt_ids"])
            obs = tuple(p) if prev is None else tuple(p[_common(prev, p):]) or tuple(p)  # nothing new: the context
            r = float(rec.get("reward", 0.0)) + (outcomes[t] if k == len(recs) - 1 else 0.0)
            calls[(t, k)] = [obs, r]
            prev = p + list(rec["response_ids"])
    ret, episode = {}, {}
    for t, recs in enumerate(trajs):
        acc = 0.0
        for k in reversed(range(len(recs))):
            acc = calls[(t, k)][1] + gamma * acc
            ret[(t, k)] = acc
        episode[t] = sum(calls[(t, k)][1] for k in range(len(recs)))

    def normalised(value, others, leave_one_out=False):
        if leave_one_out:
            rest = list(others)
            rest.remove(value)
            return value - float(np.mean(rest)) if rest else 0.0
        if len(others) == 1:
            return 0.0
        centred = value - float(np.mean(others))
        return centred / (float(np.std(others, ddof=1)) + eps) if norm else centred

    by_group = defaultdict(list)
    for t, g in enumerate(uids):
        by_group[g].append(episode[t])
    a_e = {}
    for t, g in enumerate(uids):  # verl's GRPO: a group of one keeps its score (mean 0, std 1)
        vals = by_group[g]
        a_e[t] = (episode[t] / (1 + eps) if norm else episode[t]) if len(vals) == 1 else normalised(episode[t], vals)
    step_groups = defaultdict(list)
    for (t, k), (obs, _) in calls.items():
        step_groups[(uids[t], obs)].append(ret[(t, k)])
    return {(t, k): a_e[t] + weight * normalised(ret[(t, k)], step_groups[(uids[t], obs)],
                                                   baseline == "leave_one_out")
            for (t, k), (obs, _) in calls.items()}


def _episode_fn(norm):
    fn = get_adv_estimator_fn("grpo")
    return lambda scores, uid: run_outcome_estimator(fn, scores, uid, estimator_name="grpo",
                                                     estimator_kwargs={"norm_adv_by_std_in_grpo": norm})[0]


@st.composite
def games(draw):
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    trajs, uids, outcomes = [], [], []
    for g in range(draw(st.integers(1, 3))):
        prompt = torch.randint(1, 100, (3,))
        for _ in range(draw(st.integers(1, 4))):
            steps = draw(st.integers(1, 5))
            brk = draw(st.one_of(st.none(), st.integers(1, 4)))
            trajs.append(token_trajectory(rng, steps, break_at=brk if brk and brk < steps else None,
                                          min_obs=draw(st.integers(0, 1)), prompt=prompt, obs_vocab=2))
            uids.append(f"g{g}")
            outcomes.append(float(rng.choice(REWARDS)))
            for rec in trajs[-1][0]:
                if rng.random() < 0.5:
                    rec["reward"] = float(rng.choice(REWARDS))
    options = dict(gamma=draw(st.sampled_from([1.0, 0.9, 0.5])), weight=draw(st.sampled_from([1.0, 0.5])),
                   baseline=draw(st.sampled_from(["gigpo", "leave_one_out"])), norm=draw(st.booleans()))
    return trajs, uids, outcomes, options, seed


def _shuffled_with_padding(out, seed: int, pads: int):
    """The expanded rows in a random order with ``pads`` padding rows (traj_index -1, nothing to train)."""
    t, nt = out.tensors, out.non_tensors
    n = t["responses"].shape[0]
    perm = torch.randperm(n + pads, generator=torch.Generator().manual_seed(seed))
    copies = torch.randint(0, n, (pads,), generator=torch.Generator().manual_seed(seed))

    def grow(x):  # padding rows: copies of real rows (anchors, rewards, mask and all) that traj_index -1 disowns
        return torch.cat([x, x[copies]])[perm]
    rewards = grow(t["rm_scores"] + t.get(TURN_REWARDS, torch.zeros_like(t["rm_scores"])))
    pad = (perm >= n).numpy()
    traj = np.concatenate([nt["traj_id"], np.array(["pad"] * pads, dtype=object)])[perm.numpy()]
    steps = np.concatenate([nt["step_index"], np.zeros(pads, dtype=np.int64)])[perm.numpy()]
    src = [out.source_steps[i] if i < n else [] for i in perm.tolist()]
    return rewards, grow(t["response_mask"]), grow(t[STEP_ANCHORS]), traj_index_of(traj, pad), steps, traj, src


@settings(max_examples=60, deadline=None)
@given(games(), st.booleans(), st.integers(0, 3))
def test_gigpo_equals_the_papers_equations_on_step_and_merged_rows_in_any_order(game, merge, pads):
    trajs, uids, outcomes, opt, seed = game
    tensors, non = step_record_batch(trajs, uids, outcomes, R=80)
    out = expand_step_rows(tensors, non, merge_prefix=merge, step_anchors=True)
    rewards, mask, anchors, traj_index, steps, traj_ids, src = _shuffled_with_padding(out, seed, pads)
    first = [int(np.flatnonzero(traj_index.numpy() == t)[0]) for t in range(int(traj_index.max()) + 1)]
    traj_uid = np.array([uids[int(traj_ids[b][1:])] for b in first], dtype=object)
    adv, metrics = gigpo_advantages(rewards, mask, traj_index, steps, anchors, traj_uid, _episode_fn(opt["norm"]),
                                    gamma=opt["gamma"], weight=opt["weight"], baseline=opt["baseline"],
                                    norm_by_std=opt["norm"])
    ref = reference([t[0] for t in trajs], uids, outcomes, gamma=opt["gamma"], weight=opt["weight"],
                    baseline=opt["baseline"], norm=opt["norm"])
    opt = dict(opt, _game=(uids, outcomes))
    for b in range(adv.shape[0]):
        if traj_index[b] < 0:
            assert not adv[b].any()
            continue
        t = int(traj_ids[b][1:])
        lens = [len(trajs[t][0][k]["response_ids"]) for k in src[b]]
        chunks = adv[b][mask[b] != 0].split(lens)
        for k, chunk in zip(src[b], chunks):
            torch.testing.assert_close(chunk, torch.full_like(chunk, ref[(t, k)]), rtol=1e-4, atol=1e-4)
        assert not adv[b][mask[b] == 0].any()
    assert 0.0 <= metrics["traj_gigpo/step_adv_share"] <= 1.0
    _check_step_adv_share(metrics, ref, traj_ids, traj_index, src, mask, trajs, opt)


def _check_step_adv_share(metrics, ref, traj_ids, traj_index, src, mask, trajs, opt):
    """``step_adv_share`` = sum |w A_S| / sum (|A_E| + |w A_S|) over every loss token, token by token from the
    reference's parts (A_E: the call's combined value at weight 0)."""
    ref_e = reference([t[0] for t in trajs], *opt["_game"], gamma=opt["gamma"], weight=0.0, baseline=opt["baseline"],
                      norm=opt["norm"])
    ep = st_ = 0.0
    for b in range(mask.shape[0]):
        if traj_index[b] < 0:
            continue
        t = int(traj_ids[b][1:])
        for k in src[b]:
            loss = len(trajs[t][0][k]["response_ids"])  # the records carry no loss mask: every response token
            ep += loss * abs(ref_e[(t, k)])
            st_ += loss * abs(ref[(t, k)] - ref_e[(t, k)])
    expected = st_ / (ep + st_) if ep + st_ > 0 else 0.0
    assert metrics["traj_gigpo/step_adv_share"] == pytest.approx(expected, rel=1e-3, abs=1e-4)


def _calls(traj, order, anchor):
    """Calls without rows (the synthetic tests work per call)."""
    traj, order = torch.as_tensor(traj), torch.as_tensor(order)
    return StepCalls(row=torch.arange(traj.numel()), anchor=torch.as_tensor(anchor), traj=traj, order=order,
                     token_call=torch.zeros(0, 0, dtype=torch.long), num_trajectories=int(traj.max()) + 1)


def test_a_call_alone_in_its_step_group_gets_no_step_advantage():
    returns = torch.tensor([1.0, 3.0, 5.0], dtype=torch.float64)
    group = torch.tensor([0, 0, 1])
    for baseline in ("gigpo", "leave_one_out"):
        adv = step_group_advantages(returns, group, baseline=baseline, norm_by_std=False)
        assert adv.tolist() == [-1.0, 1.0, 0.0] if baseline == "gigpo" else [-2.0, 2.0, 0.0]


def test_discounted_returns_run_along_each_trajectorys_calls_in_order():
    calls = _calls([0, 1, 0, 0, 1], [2, 0, 0, 1, 1], [1, 1, 1, 1, 1])  # trajectory 0's calls out of order
    returns = discounted_step_returns(calls, torch.tensor([1.0, 2.0, 0.0, 0.0, 4.0]), 0.5)
    assert returns.tolist() == [1.0, 4.0, 0.25, 0.5, 4.0]


def test_missing_anchor_keys_and_non_finite_rewards_are_refused():
    anchors = torch.tensor([[0, 0, 7, 0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    with pytest.raises(TrajInputError, match="step_anchors") as info:
        StepCalls.build(anchors, torch.tensor([0]), [0], mask)
    assert "anchor_keys" in str(info.value) and "row 0" in str(info.value)
    calls = StepCalls.build(torch.tensor([[5, 0, 7, 0]]), torch.tensor([0]), [0], mask)
    with pytest.raises(TrajInputError, match="rewards"):
        discounted_step_returns(calls, torch.tensor([1.0, float("nan")]), 1.0)
    with pytest.raises(TrajInputError, match="step_index"):
        StepCalls.build(torch.tensor([[5, 0], [6, 0]]), torch.tensor([0, 0]), [1, 1], torch.ones(2, 2))


def test_per_turn_index_baselines_are_biased_when_the_policy_stops_and_anchor_baselines_are_not():
    """The anchor-keyed leave-one-out baseline's estimate has the true advantage as its mean; the same estimator keyed
    by turn index (verl RFC 7244's per-turn normalisation) does not: the calls at turn k mix found and not-found
    states, and how many of each survive to turn k depends on when the policy stopped."""
    calls, true = stopping_game(groups=4000, n=8, turns=4, seed=0)
    worst = {}
    for key in ("anchor", "turn_index"):
        est, peer = baseline_estimates(calls, 8, key, "leave_one_out")
        cells = estimate_cells(calls, true, est, peer)
        assert len(cells) >= 8
        if key == "anchor":
            for c in cells:
                assert abs(c["mean"] - c["true"]) < 5 * c["se"] + 1e-3, c
        worst[key] = max(abs(c["mean"] - c["true"]) / c["se"] for c in cells)
    assert worst["turn_index"] > 20, worst  # many standard errors off on some (turn, state, action)


def test_the_outcome_of_a_call_that_generated_nothing_still_counts():
    """Regression (review): a last call with no response token carries the outcome on a row with no call; the
    trajectory's return keeps it (GRPO's half) and its last trained call is credited with it (the step half)."""
    prompt = [5, 6, 7]
    trajs = []
    for last_empty in (True, False):
        records = [{"prompt_ids": prompt, "response_ids": [11, 12], "response_logprobs": [-0.1, -0.1]},
                   {"prompt_ids": prompt + [11, 12, 201], "response_ids": [] if last_empty else [13],
                    "response_logprobs": [] if last_empty else [-0.1]}]
        response = torch.tensor([11, 12, 201] + ([] if last_empty else [13]))
        mask = torch.tensor([1, 1, 0] + ([] if last_empty else [1]))
        trajs.append((records, torch.tensor(prompt), response, mask, torch.zeros(response.numel())))
    tensors, non = step_record_batch(trajs, ["g", "g"], [1.0, 0.0], R=8)
    out = expand_step_rows(tensors, non, merge_prefix=False, step_anchors=True)
    t = out.tensors
    rewards = t["rm_scores"]
    adv, _ = gigpo_advantages(rewards, t["response_mask"], traj_index_of(out.non_tensors["traj_id"]),
                              out.non_tensors["step_index"], t[STEP_ANCHORS], np.array(["g", "g"], dtype=object),
                              _episode_fn(False), gamma=1.0, weight=1.0, norm_by_std=False)
    # episode: returns 1 and 0 -> +0.5 / -0.5; the first calls share the prompt: returns 1 and 0 -> +0.5 / -0.5
    assert adv[0][t["response_mask"][0] != 0].tolist() == [1.0, 1.0]
    assert adv[2][t["response_mask"][2] != 0].tolist() == [-1.0, -1.0]


def test_the_baseline_benchmark_prints_the_docs_table(capsys):
    """``scripts/bench_step_baselines.py`` (the table in docs/stepwise.md): one row per (turn, state, action) with
    every baseline's mean estimate; at this size too, per-turn-index gets the sign of searching on after finding the
    answer wrong and the anchor baseline does not."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "bench_step_baselines.py"
    spec = importlib.util.spec_from_file_location("bench_step_baselines", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.run(groups=1500, seed=1)
    row = next(r for r in rows if r["turn"] == 0 and r["found"] and not r["stops"])
    assert row["true"] < 0 < row["turn_index/leave_one_out"] and row["anchor/leave_one_out"] < 0
    bench.main(["--groups", "300"])
    assert capsys.readouterr().out.startswith("| turn, state, action | true |")
