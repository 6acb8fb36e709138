"""Fuzzing the step rows' credit entries (issue 28, item 8): the timeline estimators (``Timeline``,
``timeline_advantages``), the outcome estimators (``compute_trajectory_advantages`` and its parts), the
trajectory-scoped correction (``trajectory_rollout_correction``, ``group_log_ratio_sums``, ``sequence_ratio_shift``)
and the DataProto-level wrappers of :mod:`verl_traj.integration.rows.stepwise_rows`. Each gets a valid batch of step
rows and one random corruption (duplicate steps, out-of-range trajectory indices, widths that do not match the mask,
NaN / inf, wrong dtypes, misspelled options); only the clean result (harmless corruptions) or a
:class:`~verl_traj.core.TrajInputError` whose ``field`` is set and named in its message are accepted. Then one
regression test per class of bug the fuzzing found."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from verl.trainer.ppo import ray_trainer
from verl.trainer.ppo.core_algos import get_adv_estimator_fn
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch as verl_add
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask as verl_correction

from tests.stepwise.verl_batches import planned_stepwise_batch
from tests.fuzz import INF, NAN, refused, run
from verl_traj.core import TrajInputError
from verl_traj.core.keys import TURN_REWARDS
from verl_traj.integration.rows.stepwise_rows import stepwise_advantage, trajectory_scoped_correction
from verl_traj.stepwise.advantages import (broadcast_step_advantages, compute_trajectory_advantages, last_step_rows,
                                           run_outcome_estimator, trajectory_scores)
from verl_traj.stepwise.ratios import group_log_ratio_sums, sequence_ratio_shift, trajectory_rollout_correction
from verl_traj.stepwise.timeline import Timeline, timeline_advantages


FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
GAE = get_adv_estimator_fn("gae")
GRPO = get_adv_estimator_fn("grpo")


def _rows(seed: int, padding_rows: int = 1) -> dict:
    """Step rows of 1..4 trajectories (1..3 turns each) in a random order, plus padding rows: traj / step / last /
    uid per row, and ``[B, R]`` rewards, values, log-probs and a right-padded 0/1 mask."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    rows = []
    for t in range(int(rng.integers(1, 5))):
        turns = int(rng.integers(1, 4))
        rows += [(t, i, i == turns - 1, int(rng.integers(2, 5))) for i in range(turns)]  # verl whitens: >= 2 tokens
    rows = [rows[i] for i in rng.permutation(len(rows))] + [(-1, 0, True, 0)] * padding_rows
    B, R = len(rows), max(r[3] for r in rows) + 1
    mask = torch.zeros(B, R)
    for b, r in enumerate(rows):
        mask[b, : r[3]] = 1
    return dict(traj=torch.tensor([r[0] for r in rows]), step=torch.tensor([r[1] for r in rows]),
                last=np.array([r[2] for r in rows]),
                uid=np.array([f"u{max(r[0], 0) // 2}" for r in rows], dtype=object),
                mask=mask, rewards=torch.rand(B, R, generator=g) * mask, values=torch.randn(B, R, generator=g),
                old=-torch.rand(B, R, generator=g) * 2, roll=-torch.rand(B, R, generator=g) * 2)


def _real_row(d: dict, rng, with_loss: bool = False) -> int:
    ok = (d["traj"] >= 0) & ((d["mask"].sum(-1) > 0) if with_loss else True)
    return int(rng.choice(torch.nonzero(ok).reshape(-1).numpy()))


def _same_traj_other_row(d: dict, r: int) -> int:
    same = torch.nonzero(d["traj"] == d["traj"][r]).reshape(-1).tolist()
    return next((x for x in same if x != r), -1)


ROW_KINDS = ["none", "step_dup", "step_neg", "step_frac", "step_str", "traj_below", "traj_gap", "traj_short",
             "step_short", "mask_two", "mask_1d", "rewards_wide", "rewards_narrow", "values_wide", "rewards_nan_loss",
             "rewards_nan_masked", "values_inf_loss", "step_float_whole", "step_gap", "traj_list"]


def _corrupt_rows(kind: str, d: dict, rng) -> str:
    """Apply ``kind`` to the per-row inputs in place; returns the expectation for the timeline entries."""
    r = _real_row(d, rng, with_loss=kind.endswith("_loss"))
    if kind == "step_dup":
        other = _same_traj_other_row(d, r)
        if other < 0:
            return "ok"
        d["step"] = d["step"].clone()
        d["step"][r] = d["step"][other]
    elif kind in ("step_neg", "traj_below"):
        key = "step" if kind == "step_neg" else "traj"
        d[key] = d[key].clone()
        d[key][r] = -1 if kind == "step_neg" else -2
    elif kind in ("step_frac", "step_float_whole"):
        d["step"] = d["step"].double() + (0.5 if kind == "step_frac" else 0.0)
        return "refuse" if kind == "step_frac" else "ok"
    elif kind == "step_str":
        d["step"] = d["step"].numpy().astype(str)
    elif kind == "step_gap":  # steps need only increase within a trajectory (v1's output index)
        d["step"] = d["step"] * 3
        return "ok"
    elif kind == "traj_gap":
        d["traj"] = torch.where(d["traj"] >= 0, d["traj"] + 1, d["traj"])
    elif kind in ("traj_short", "step_short"):
        key = "traj" if kind == "traj_short" else "step"
        d[key] = d[key][:-1]
    elif kind == "traj_list":
        d["traj"] = d["traj"].tolist()
        return "ok"
    elif kind == "mask_two":
        d["mask"] = d["mask"] * 2
    elif kind == "mask_1d":
        d["mask"] = d["mask"].sum(-1)
    elif kind in ("rewards_wide", "values_wide"):
        key = "rewards" if kind == "rewards_wide" else "values"
        d[key] = torch.cat([d[key], torch.zeros(d[key].shape[0], 1)], 1)
    elif kind == "rewards_narrow":
        d["rewards"] = d["rewards"][:, :-1]
    elif kind in ("rewards_nan_loss", "values_inf_loss", "rewards_nan_masked"):
        key = "values" if kind == "values_inf_loss" else "rewards"
        d[key] = d[key].clone()
        if kind == "rewards_nan_masked":
            d[key][r, -1] = NAN  # the last column is never a loss token
            return "ok"
        d[key][r, 0] = NAN if key == "rewards" else INF
    else:
        return "ok"
    return "refuse"


def _timeline_run(d: dict):
    timeline = Timeline.build(d["traj"], d["step"], d["mask"])
    return timeline_advantages(GAE, timeline, d["rewards"], d["mask"], values=d["values"],
                               estimator_kwargs={"gamma": 0.9, "lam": 0.8})


@FUZZ
@given(seed=st.integers(0, 10_000), padding_rows=st.integers(0, 2), kind=st.sampled_from(ROW_KINDS))
def test_fuzz_timeline_advantages(seed, padding_rows, kind):
    d = _rows(seed, padding_rows)
    clean = _timeline_run(d)
    expect = _corrupt_rows(kind, d, np.random.default_rng(seed))
    out = run(_timeline_run, expect, d)
    if out is not None:
        for a, b in zip(out, clean):
            torch.testing.assert_close(a, b)


TIMELINE_ARG_KINDS = ["index_short", "index_ok", "kwargs_list", "mask_other", "rewards_list"]


@FUZZ
@given(seed=st.integers(0, 10_000), kind=st.sampled_from(TIMELINE_ARG_KINDS))
def test_fuzz_timeline_arguments(seed, kind):
    d = _rows(seed)
    timeline = Timeline.build(d["traj"], d["step"], d["mask"])
    kw = dict(values=d["values"], estimator_kwargs={"gamma": 0.9, "lam": 0.8})
    rewards, mask, expect = d["rewards"], d["mask"], "refuse"
    index = d["uid"][timeline.first_row.numpy()]
    if kind == "index_short":
        kw["index"] = index[:-1]
    elif kind == "index_ok":
        fn = get_adv_estimator_fn("reinforce_plus_plus_baseline")
        run(timeline_advantages, "ok", fn, timeline, rewards, mask, index=index,
            estimator_kwargs={"config": OmegaConf.create({"gamma": 1.0})})
        return
    elif kind == "kwargs_list":
        kw["estimator_kwargs"] = [("gamma", 0.9)]
    elif kind == "mask_other":
        mask = mask[:, :-1]
    elif kind == "rewards_list":
        rewards = rewards.tolist()
    run(timeline_advantages, expect, GAE, timeline, rewards, mask, **kw)


OUTCOME_KINDS = ["none", "traj_below", "traj_gap", "traj_short", "last_dup", "last_none", "last_two", "last_str",
                 "last_short", "uid_short", "rewards_wide", "rewards_nan_last", "rewards_nan_earlier", "mask_two",
                 "estimator_typo", "reduction_typo", "baselines_short", "traj_list", "last_int"]


def _outcome(d: dict, name: str = "grpo", reduction: str = "last_step", baselines=None):
    return compute_trajectory_advantages(d["rewards"], d["mask"], d["traj"], d["last"], d["uid"],
                                         estimator_fn=GRPO, estimator_name=name, reward_reduction=reduction,
                                         reward_baselines=baselines)


@FUZZ
@given(seed=st.integers(0, 10_000), padding_rows=st.integers(0, 2), kind=st.sampled_from(OUTCOME_KINDS))
def test_fuzz_outcome_advantages(seed, padding_rows, kind):
    d = _rows(seed, padding_rows)
    clean = _outcome(d)
    rng = np.random.default_rng(seed)
    r = _real_row(d, rng)
    kw, expect = {}, "refuse"
    last_rows = np.flatnonzero(d["last"] & (d["traj"].numpy() >= 0))
    if kind in ("traj_below", "traj_gap", "traj_short", "traj_list", "rewards_wide", "mask_two"):
        expect = _corrupt_rows(kind, d, rng)
    elif kind == "last_dup":  # an earlier step flagged last too: its trajectory has two
        earlier = np.flatnonzero(~d["last"] & (d["traj"].numpy() >= 0))
        d["last"] = d["last"].copy()
        d["last"][earlier[:1]] = True
        expect = "refuse" if earlier.size else "ok"
    elif kind == "last_none":
        d["last"] = d["last"].copy()
        d["last"][int(last_rows[0])] = False
    elif kind in ("last_two", "last_str", "last_int"):
        col = d["last"].astype({"last_two": float, "last_str": object, "last_int": int}[kind])
        if kind != "last_int":
            col[r] = 2.0 if kind == "last_two" else "yes"
        d["last"] = col
        expect = "ok" if kind == "last_int" else "refuse"
    elif kind in ("last_short", "uid_short"):
        key = "last" if kind == "last_short" else "uid"
        d[key] = d[key][:-1]
    elif kind in ("rewards_nan_last", "rewards_nan_earlier"):
        d["rewards"] = d["rewards"].clone()
        row = int(last_rows[0]) if kind == "rewards_nan_last" else r
        d["rewards"][row, 0] = NAN
        expect = "refuse" if kind == "rewards_nan_last" or bool(d["last"][r]) else "ok"  # last_step reads last rows
    elif kind == "estimator_typo":
        kw["name"] = "grpoo"
    elif kind == "reduction_typo":
        kw["reduction"] = "sums"
    elif kind == "baselines_short":
        kw["baselines"] = torch.zeros(len(d["last"]) - 1)
    else:
        expect = "ok"
    if kind == "rewards_nan_earlier" and expect == "ok":
        clean = _outcome(dict(d, rewards=torch.nan_to_num(d["rewards"])))
    out = run(_outcome, expect, d, **kw)
    if out is not None:
        for a, b in zip(out, clean):
            torch.testing.assert_close(a, b)


PART_KINDS = ["scores_2d", "scores_nan", "group_uid_short", "loss_tokens_short", "kwargs_list", "adv_short",
              "last_row_high", "rewards_1d", "bad_estimator_output", "broadcast_mask_1d"]


@FUZZ
@given(seed=st.integers(0, 10_000), kind=st.sampled_from(PART_KINDS))
def test_fuzz_outcome_parts(seed, kind):
    """The public parts of the outcome path, each with one bad argument."""
    d = _rows(seed)
    last = last_step_rows(d["traj"], d["last"])
    scores = trajectory_scores(d["rewards"], d["traj"], last)
    uid = d["uid"][last.numpy()]
    T = scores.numel()
    if kind == "scores_2d":
        run(run_outcome_estimator, "refuse", GRPO, scores[:, None], uid)
    elif kind == "scores_nan":
        run(run_outcome_estimator, "refuse", GRPO, torch.full_like(scores, NAN), uid)
    elif kind == "group_uid_short":
        run(run_outcome_estimator, "refuse", GRPO, scores, uid[:-1])
    elif kind == "loss_tokens_short":
        run(run_outcome_estimator, "refuse", GRPO, scores, uid, estimator_name="opo", loss_tokens=torch.ones(T + 1))
    elif kind == "kwargs_list":
        run(run_outcome_estimator, "refuse", GRPO, scores, uid, estimator_kwargs=["x"])
    elif kind == "bad_estimator_output":
        run(run_outcome_estimator, "refuse", lambda **k: (None, None), scores, uid)
    elif kind == "adv_short":
        run(broadcast_step_advantages, "refuse", scores[:-1], d["traj"], d["mask"])
    elif kind == "last_row_high":
        run(trajectory_scores, "refuse", d["rewards"], d["traj"], last + len(d["last"]))
    elif kind == "rewards_1d":
        run(trajectory_scores, "refuse", d["rewards"].sum(-1), d["traj"], last)
    elif kind == "broadcast_mask_1d":
        run(broadcast_step_advantages, "refuse", scores, d["traj"], d["mask"].sum(-1))


def _correction(d: dict, timeline=None):
    timeline = timeline or Timeline.build(d["traj"], d["step"], d["mask"])
    return trajectory_rollout_correction(verl_correction, timeline, d["old"], d["roll"], d["mask"],
                                         rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs=None,
                                         rollout_rs_threshold=None)


RATIO_KINDS = ["step_dup", "traj_below", "traj_gap", "traj_short", "step_neg", "none", "old_wide", "mask_narrow",
               "old_nan_loss", "roll_nan_loss", "old_nan_masked", "roll_neg_inf_masked"]


@FUZZ
@given(seed=st.integers(0, 10_000), padding_rows=st.integers(0, 2), kind=st.sampled_from(RATIO_KINDS))
def test_fuzz_trajectory_rollout_correction(seed, padding_rows, kind):
    d = _rows(seed, padding_rows)
    clean = _correction(d)
    rng = np.random.default_rng(seed)
    r = _real_row(d, rng, with_loss=True)
    timeline, expect = None, "refuse"
    if kind in ("step_dup", "traj_below", "traj_gap", "traj_short", "step_neg"):
        expect = _corrupt_rows(kind, d, rng)
    elif kind == "old_wide":
        d["old"] = torch.cat([d["old"], d["old"][:, :1]], 1)
    elif kind == "mask_narrow":
        timeline = Timeline.build(d["traj"], d["step"], d["mask"])
        d["mask"] = d["mask"][:, :-1]
    elif kind in ("old_nan_loss", "roll_nan_loss", "old_nan_masked", "roll_neg_inf_masked"):
        key = "old" if kind.startswith("old") else "roll"
        d[key] = d[key].clone()
        d[key][r, 0 if kind.endswith("_loss") else -1] = NAN if "nan" in kind else -INF
        expect = "refuse" if kind.endswith("_loss") else "ok"
    else:
        expect = "ok"
    out = run(_correction, expect, d, timeline)
    if out is not None:
        torch.testing.assert_close(out.weights, clean.weights)
        assert torch.equal(out.response_mask, clean.response_mask)


GSPO_KINDS = ["none", "group_high", "group_below", "num_groups_neg", "num_groups_nan", "old_narrow", "mask_rows",
              "log_prob_nan_loss", "log_prob_nan_padding", "group_float_whole", "sums_short", "sums_1d"]


@FUZZ
@given(seed=st.integers(0, 10_000), kind=st.sampled_from(GSPO_KINDS))
def test_fuzz_group_log_ratio_sums_and_shift(seed, kind):
    d = _rows(seed, padding_rows=1)
    lp = d["old"] + 0.1 * torch.randn(d["old"].shape, generator=torch.Generator().manual_seed(seed))
    group, num = d["traj"].clone(), int(d["traj"].max()) + 1
    args = [lp, d["old"], d["mask"], group, num]
    clean = group_log_ratio_sums(*args)
    expect = "refuse"
    r = _real_row(d, np.random.default_rng(seed), with_loss=True)
    if kind == "group_high":
        args[3] = group.clone()
        args[3][r] = num
    elif kind == "group_below":
        args[3] = group.clone()
        args[3][r] = -2
    elif kind in ("num_groups_neg", "num_groups_nan"):
        args[4] = -1 if kind == "num_groups_neg" else NAN
    elif kind == "old_narrow":
        args[1] = d["old"][:, :-1]
    elif kind == "mask_rows":
        args[2] = d["mask"][:-1]
    elif kind in ("log_prob_nan_loss", "log_prob_nan_padding"):
        args[0] = lp.clone()
        pad = int(torch.nonzero(group < 0)[0, 0])
        args[0][r if kind.endswith("loss") else pad, 0] = NAN
        expect = "refuse" if kind.endswith("loss") else "ok"
    elif kind == "group_float_whole":
        args[3], expect = group.double(), "ok"
    elif kind in ("sums_short", "sums_1d"):
        sums = clean[:-1] if kind == "sums_short" else clean[:, 0]
        run(sequence_ratio_shift, "refuse", lp, d["old"], d["mask"], group, sums)
        return
    else:
        expect = "ok"
    out = run(group_log_ratio_sums, expect, *args)
    if out is not None:
        torch.testing.assert_close(out, clean)
        shift = sequence_ratio_shift(args[0], d["old"], d["mask"], group, out)
        assert bool(torch.isfinite(shift).all())


# ---------------------------------------------------------------------------------------------------------------------
# DataProto level (integration/rows/stepwise_rows.py)
# ---------------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _planned(seed: int):
    data = planned_stepwise_batch(seed, merge=bool(seed % 2), turn_rewards=True)[0]
    B, R = data.batch["response_mask"].shape
    g = torch.Generator().manual_seed(seed)
    data.batch["values"] = torch.randn(B, R, generator=g)
    data.batch["old_log_probs"] = data.batch["rollout_log_probs"] + 0.05 * torch.randn(B, R, generator=g)
    return data


DATA_KINDS = ["none", "step_dup", "step_str", "step_none", "step_missing", "traj_below", "traj_high_gap",
              "turn_nan", "turn_wide_values", "uid_missing", "uid_short", "values_missing", "last_str",
              "rollout_missing", "reward_nan"]
STEP_ADVANTAGE = stepwise_advantage(ray_trainer.compute_advantage)
CORRECTION = trajectory_scoped_correction(verl_add)
CORR_CONFIG = OmegaConf.create({"rollout_is": "sequence", "rollout_is_threshold": 5.0, "rollout_rs": None,
                                "rollout_rs_threshold": None})


def _corrupt_data(kind: str, data, rng) -> str:
    td, nt = data.batch, data.non_tensor_batch
    real = torch.nonzero(td["traj_index"] >= 0).reshape(-1).numpy()
    r = int(rng.choice(real))
    if kind == "step_dup":
        same = [x for x in real.tolist() if x != r and int(td["traj_index"][x]) == int(td["traj_index"][r])]
        if not same:
            return "ok"
        nt["step_index"] = nt["step_index"].copy()
        nt["step_index"][r] = nt["step_index"][same[0]]
    elif kind in ("step_str", "step_none", "last_str"):
        key = "is_last_step" if kind == "last_str" else "step_index"
        nt[key] = nt[key].astype(object)
        nt[key][r] = None if kind == "step_none" else "x"
    elif kind in ("step_missing", "uid_missing"):
        nt.pop("step_index" if kind == "step_missing" else "uid")
    elif kind == "uid_short":
        nt["uid"] = nt["uid"][:-1]
    elif kind in ("traj_below", "traj_high_gap"):
        ti = td["traj_index"].clone()
        ti[r] = -2 if kind == "traj_below" else int(ti.max()) + 2
        td["traj_index"] = ti
    elif kind in ("turn_nan", "reward_nan"):
        key = TURN_REWARDS if kind == "turn_nan" else "token_level_rewards"
        t = td[key].clone()
        t[r, 0] = NAN
        td[key] = t
    elif kind == "values_missing":
        td.pop("values")
    elif kind == "rollout_missing":
        td.pop("rollout_log_probs")
    else:
        return "ok"
    return "refuse"


@FUZZ
@given(seed=st.integers(0, 3), estimator=st.sampled_from(["grpo", "gae", "correction"]),
       kind=st.sampled_from(DATA_KINDS), pick=st.integers(0, 10_000))
def test_fuzz_dataproto_entries(seed, estimator, kind, pick):
    base = _planned(seed)

    def call(data):
        if estimator == "correction":
            return CORRECTION(data, CORR_CONFIG)[0]
        return STEP_ADVANTAGE(data, estimator, gamma=0.9, lam=0.8, config=OmegaConf.create({}))

    clean = call(copy.deepcopy(base))
    data = copy.deepcopy(base)
    expect = _corrupt_data(kind, data, np.random.default_rng(pick))
    used = {"grpo": {"traj_below", "traj_high_gap", "turn_nan", "uid_missing", "uid_short", "last_str", "reward_nan"},
            "gae": {"step_dup", "step_str", "step_none", "step_missing", "traj_below", "traj_high_gap", "turn_nan",
                    "values_missing", "reward_nan"},
            "correction": {"step_dup", "step_str", "step_none", "step_missing", "traj_below", "traj_high_gap",
                           "rollout_missing"}}[estimator]
    if kind not in used:
        expect = "any"  # a field this entry does not read
    if estimator == "grpo" and kind == "reward_nan" and not bool(data.non_tensor_batch["is_last_step"][
            int(torch.nonzero(torch.isnan(data.batch["token_level_rewards"][:, 0]))[0, 0])]):
        expect = "ok"  # an earlier row's reward is not the outcome (last_step reduction)
    out = run(call, expect, data)
    if out is not None and expect == "ok":
        key = "rollout_is_weights" if estimator == "correction" else "advantages"
        torch.testing.assert_close(out.batch[key], clean.batch[key])


# ---------------------------------------------------------------------------------------------------------------------
# Regressions
# ---------------------------------------------------------------------------------------------------------------------


def _refuses(fn, *args, **kwargs) -> TrajInputError:
    with pytest.raises(TrajInputError) as exc:
        fn(*args, **kwargs)
    refused(exc.value)
    return exc.value


def _two_trajectories():
    traj, step = torch.tensor([0, 0, 1, -1]), torch.tensor([0, 1, 0, 0])
    mask = torch.tensor([[1.0, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]])
    return traj, step, mask


def test_duplicate_steps_of_one_trajectory_are_refused_by_the_timeline():
    traj, step, mask = _two_trajectories()
    err = _refuses(Timeline.build, traj, torch.tensor([0, 0, 0, 0]), mask)
    assert err.field == "step_index[1]" and "repeats the step of row 0 in trajectory 0" in str(err)
    assert _refuses(Timeline.build, traj, torch.tensor([0, -1, 0, 0]), mask).field == "step_index[1]"


def test_trajectory_indices_out_of_range_are_refused_not_an_index_error():
    traj, step, mask = _two_trajectories()
    assert _refuses(Timeline.build, torch.tensor([0, 0, -2, -1]), step, mask).field == "traj_index[2]"
    err = _refuses(Timeline.build, torch.tensor([0, 0, 2, -1]), step, mask)  # trajectory 1 has no row
    assert err.field == "traj_index" and "skips trajectory 1" in str(err)
    assert _refuses(Timeline.build, traj[:-1], step, mask).field == "traj_index"
    lp = torch.zeros(4, 3)
    assert _refuses(group_log_ratio_sums, lp, lp, mask, torch.tensor([0, 0, 2, -1]), 2).field == "group[2]"
    assert _refuses(sequence_ratio_shift, lp, lp, mask, traj, torch.zeros(1, 2)).field == "group[2]"
    last = np.array([False, True, True, True])
    assert _refuses(last_step_rows, torch.tensor([0, 0, 2, -1]), last).field == "traj_index"
    assert _refuses(broadcast_step_advantages, torch.zeros(1), traj, mask).field == "traj_scalar_adv"


def test_reward_and_value_widths_must_match_the_mask():
    traj, step, mask = _two_trajectories()
    timeline = Timeline.build(traj, step, mask)
    wide, narrow = torch.zeros(4, 4), torch.zeros(4, 2)
    assert _refuses(timeline_advantages, GAE, timeline, narrow, mask, values=torch.zeros(4, 3)).field \
        == "token_level_rewards"
    assert _refuses(timeline_advantages, GAE, timeline, torch.zeros(4, 3), mask, values=wide).field == "values"
    assert _refuses(trajectory_rollout_correction, verl_correction, timeline, torch.zeros(4, 3), torch.zeros(4, 3),
                    narrow).field == "response_mask"
    assert _refuses(trajectory_rollout_correction, verl_correction, timeline, wide, torch.zeros(4, 3), mask).field \
        == "old_log_prob"


def test_a_nan_turn_reward_names_the_turn_rewards_not_the_reward_function():
    for estimator in ("grpo", "gae"):
        data = copy.deepcopy(_planned(0))
        turn = data.batch[TURN_REWARDS].clone()
        row = int(torch.nonzero(data.batch["traj_index"] >= 0)[0, 0])
        turn[row, 0] = NAN
        data.batch[TURN_REWARDS] = turn
        err = _refuses(STEP_ADVANTAGE, data, estimator, gamma=0.9, lam=0.8, config=OmegaConf.create({}))
        assert err.field == TURN_REWARDS and "step_rewards" in str(err) and "reward function" not in str(err)
    data = copy.deepcopy(_planned(0))
    rewards = data.batch["token_level_rewards"].clone()
    last = torch.as_tensor(data.non_tensor_batch["is_last_step"]) & (data.batch["traj_index"] >= 0)
    rewards[torch.nonzero(last)[0, 0], 0] = NAN
    data.batch["token_level_rewards"] = rewards
    err = _refuses(STEP_ADVANTAGE, data, "grpo", config=OmegaConf.create({}))
    assert err.field == "token_level_rewards" and "reward function" in str(err)


def test_step_index_columns_of_strings_or_none_are_refused():
    data = copy.deepcopy(_planned(1))
    nt = data.non_tensor_batch
    nt["step_index"] = nt["step_index"].astype(object)
    nt["step_index"][0] = "one"
    assert _refuses(STEP_ADVANTAGE, data, "gae", config=OmegaConf.create({})).field == "step_index"
    nt["step_index"][0] = None
    assert _refuses(CORRECTION, data, CORR_CONFIG).field.startswith("step_index")
    data = copy.deepcopy(_planned(1))
    data.batch.pop("values")
    assert _refuses(STEP_ADVANTAGE, data, "gae", config=OmegaConf.create({})).field == "values"


def test_a_misspelled_estimator_or_reduction_is_named():
    d = _rows(0)
    err = _refuses(_outcome, d, name="grpoo")
    assert err.field == "adv_estimator"
    assert _refuses(_outcome, d, reduction="sums").field == "reward_reduction"
