"""verl's v1 trainer beyond what ``test_traj_training`` checks on both trainers: the asynchronous
``colocate_async`` mode (generation overlaps training; rows of older policies are trained) and the gradient's
independence of the data-parallel layout on the v1 path (TransferQueue, padding rows, dispatch)."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from tests.e2e.runs import DP2_CONFIG, dp2_reference, tail

pytestmark = pytest.mark.e2e


def test_colocate_async_trains_whole_units_of_one_policy_version(run_training, tmp_path):
    """3 steps of ``trainer.v1.trainer_mode=colocate_async``. A unit (group, trajectory) is sampled and planned
    as a whole within one step, so every optimizer step sees all of it under one policy version; rows generated
    by an older policy (staleness >= 1) keep their own rollout log-probs (they differ from the recomputed
    pi_old), and the planner still gives the configured optimizer steps with no split unit."""
    dump = tmp_path / "dump"
    run = run_training(["trainer.v1.trainer_mode=colocate_async", "trainer.total_training_steps=3"],
                       timeout=480, extra_env={"VERL_TRAJ_DEBUG_DUMP": str(dump)})
    assert run.returncode == 0, tail(run.output, 80)
    steps = [m for m in run.metrics if "actor/num_optimizer_steps" in m]
    assert len(steps) == 3, tail(run.output)
    for m in steps:
        assert m["actor/num_optimizer_steps"] == 2 and m["traj_plan/split_groups"] == 0
        assert m["traj_plan/split_trajectories"] == 0
    assert steps[0]["training/off_policy/trajectory_staleness/max"] == 0
    assert steps[0]["training/rollout_probs_diff_max"] < 1e-6  # on-policy: pi_old == rollout policy
    stale = [m for m in steps[1:] if m["training/off_policy/trajectory_staleness/max"] >= 1]
    assert stale, "no step trained rows of an older policy; the test would not exercise asynchrony"
    assert all(m["training/rollout_probs_diff_max"] > 1e-6 for m in stale)
    step_of_uid = defaultdict(set)
    for rec in map(json.loads, (dump / "plan.jsonl").read_text().splitlines()):
        for uid, pad in zip(rec["uid"], rec["is_padding"]):
            if not pad:
                step_of_uid[uid].add(rec["step"])
    assert step_of_uid and all(len(s) == 1 for s in step_of_uid.values())  # a group is trained in one step


def _first_step(run):
    assert run.returncode == 0, tail(run.output, 80)
    return next(m for m in run.metrics if "actor/grad_norm" in m)


def test_v1_gradient_is_the_same_on_one_and_two_ranks(run_training, shared_run):
    """PPO, two mini-batches of 3 groups x 3 rows: 9 rows each, so two ranks need a padding row in each. Same seed,
    same rollouts (deterministic CPU sampling), the same seeded value head (so the same GAE advantages) and the
    same units per mini-batch (assigned before DP balancing), so the first step's gradients (norm before clipping, mean over its two optimizer steps) and loss must agree
    between dp=1 and dp=2: loss normalisation is global, padding rows weigh nothing and the token cap's
    micro-batch cut does not matter. The dp=2 run is shared (``dp2_reference``)."""
    two = _first_step(shared_run(dp2_reference("v1"), config_name=DP2_CONFIG))
    one = _first_step(run_training(dp2_reference("v1", dp=1)[:-1] + ["trainer.total_training_steps=1"],
                                   config_name=DP2_CONFIG, timeout=420))
    assert one["traj_plan/padding_rows"] == 0 and two["traj_plan/padding_rows"] == 2
    assert one["actor/lr"] == two["actor/lr"]  # the same schedule at step 1, whatever the run's length
    assert one["critic/score/mean"] == two["critic/score/mean"]  # the same rollouts
    assert two["critic/values/mean"] == pytest.approx(one["critic/values/mean"], rel=1e-4, abs=1e-6)  # one seeded critic
    assert two["actor/grad_norm"] == pytest.approx(one["actor/grad_norm"], rel=1e-5)
    assert two["actor/pg_loss"] == pytest.approx(one["actor/pg_loss"], rel=1e-4, abs=1e-7)
