"""verl's v1 trainer beyond what ``test_traj_training`` checks on both trainers: the asynchronous
``colocate_async`` and ``separate_async`` modes (generation overlaps training; rows of older policies are trained) and
the gradient's independence of the data-parallel layout on the v1 path (TransferQueue, padding rows, dispatch)."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from tests.e2e.runs import DP2_CAP, DP2_CONFIG, ULYSSES_2, dp2_reference, tail

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
    assert _trained_once_per_group(dump)  # a group is trained in one step


def _trained_once_per_group(dump) -> bool:
    step_of_uid = defaultdict(set)
    for rec in map(json.loads, (dump / "plan.jsonl").read_text().splitlines()):
        for uid, pad in zip(rec["uid"], rec["is_padding"]):
            if not pad:
                step_of_uid[uid].add(rec["step"])
    return bool(step_of_uid) and all(len(s) == 1 for s in step_of_uid.values())


def test_separate_async_trains_on_cpu_with_weights_synced_over_gloo(run_training, tmp_path):
    """The user's one override, ``trainer.v1.trainer_mode=separate_async``, on the CPU preset: the platform derives
    verl's sync step (train_batch_size / ppo_mini_batch_size = 2 local updates per weight sync), gives the mode a
    standalone rollout pool and syncs weights to it over gloo (verl_traj.cpu.weight_sync). Half a batch of warm-up
    makes every step mix rows of the previous policy with rows of the current one: the stale rows keep their own
    rollout log-probs (they differ from the recomputed pi_old), the current ones match pi_old at rounding level on
    every step (``traj_version/current_policy_probs_diff_max``: the sync arrived; ~1e-3 if it had not), each local
    update is one planned mini-batch, run as planned, and each group is trained in exactly one step."""
    dump = tmp_path / "dump"
    run = run_training(["trainer.v1.trainer_mode=separate_async", "trainer.total_training_steps=3",
                        "trainer.v1.separate_async.num_warmup_batches=0.5"],
                       timeout=480, extra_env={"VERL_TRAJ_DEBUG_DUMP": str(dump)})
    assert run.returncode == 0, tail(run.output, 80)
    assert "separate_async.parameter_sync_step=2" in run.output and "checkpoint_engine.backend=gloo" in run.output
    steps = [m for m in run.metrics if "actor/num_optimizer_steps" in m]
    assert len(steps) == 3, tail(run.output)
    for m in steps:
        assert m["actor/num_optimizer_steps"] == 1 and m["traj_plan/split_groups"] == 0  # one mini-batch per update
        assert m["actor/micro_batches_per_epoch"] == m["traj_plan/micro_batches"]  # run = planned
        assert m["traj_version/current_policy_rows"] > 0 and m["traj_version/current_policy_probs_diff_max"] < 1e-6
        assert m["weight_sync/gloo_megabytes"] > 0
    assert steps[0]["traj_version/staleness_max"] == 0 and steps[0]["training/rollout_probs_diff_max"] < 1e-6
    stale = [m for m in steps[1:] if m["traj_version/staleness_max"] >= 1]
    assert stale, "no step trained rows of an older policy; the test would not exercise asynchrony"
    assert all(m["training/rollout_probs_diff_max"] > 1e-6 for m in stale)  # the stale rows' own log-probs
    assert _trained_once_per_group(dump)


def _first_step(run):
    assert run.returncode == 0, tail(run.output, 80)
    return next(m for m in run.metrics if "actor/grad_norm" in m)


def _one_rank_first_step(shared_run):
    """Step 1 of the dp2 reference run on one rank, padded attention (shared by the layout tests below)."""
    return _first_step(shared_run(dp2_reference("v1", dp=1)[:-1] + ["trainer.total_training_steps=1"],
                                  config_name=DP2_CONFIG, timeout=420))


def test_v1_gradient_is_the_same_on_one_and_two_ranks(shared_run):
    """PPO, two mini-batches of 3 groups x 3 rows: 9 rows each, so two ranks need a padding row in each; the two-rank
    run on verl's remove-padding path, the one-rank run on the padded path. Same seed,
    same rollouts (deterministic CPU sampling), the same seeded value head (so the same GAE advantages) and the
    same units per mini-batch (assigned before DP balancing), so the first step's gradients (norm before clipping, mean over its two optimizer steps) and loss must agree
    between dp=1 and dp=2: loss normalisation is global, padding rows weigh nothing and the token cap's
    micro-batch cut does not matter. The dp=2 run is shared (``dp2_reference``)."""
    two = _first_step(shared_run(dp2_reference("v1"), config_name=DP2_CONFIG))
    one = _one_rank_first_step(shared_run)
    assert one["traj_plan/padding_rows"] == 0 and two["traj_plan/padding_rows"] == 2
    assert one["actor/lr"] == two["actor/lr"]  # the same schedule at step 1, whatever the run's length
    assert one["critic/score/mean"] == two["critic/score/mean"]  # the same rollouts
    assert two["critic/values/mean"] == pytest.approx(one["critic/values/mean"], rel=1e-4, abs=1e-6)  # one seeded critic
    assert two["actor/grad_norm"] == pytest.approx(one["actor/grad_norm"], rel=1e-5)
    assert two["critic/grad_norm"] == pytest.approx(one["critic/grad_norm"], rel=1e-5)
    assert two["training/rollout_probs_diff_max"] < 1e-6  # remove-padding recomputes the rollout's log-probs
    assert two["actor/pg_loss"] == pytest.approx(one["actor/pg_loss"], rel=1e-4, abs=1e-7)


def test_ulysses_sequence_parallel_gradient_equals_the_data_parallel_run(run_training, shared_run):
    """Ulysses SP=2 for actor and critic on two CPU processes (one data-parallel rank): verl's own Ulysses code runs
    (the all-to-all around flash-attention's varlen call, here the CPU platform's torch varlen attention), so on the
    same rollouts the actor's recomputed log-probs match the rollout's, and the first step's gradients equal the
    one-rank run's. With sdpa the sequence shards would attend only to themselves: log-prob error 4.4e-4, gradient
    norm 0.4-1.2% off (measured before). The token cap is per sequence-parallel group, as verl defines it:
    traj.micro_batch_max_tokens x SP."""
    sp = run_training(dp2_reference("v1", dp=1)[:-1] + ULYSSES_2 + ["trainer.total_training_steps=1"],
                      config_name=DP2_CONFIG, timeout=420)
    two, one = _first_step(sp), _one_rank_first_step(shared_run)
    assert two["traj_plan/dp_size"] == 1 and two["traj_plan/padding_rows"] == 0
    assert DP2_CAP < two["traj_plan/max_packed_tokens"] <= 2 * DP2_CAP  # the cap per SP group: 160 x 2
    assert two["actor/micro_batches_per_epoch"] == two["critic/micro_batches_per_epoch"] == two["traj_plan/micro_batches"]
    assert two["training/rollout_probs_diff_max"] < 1e-6
    assert two["critic/score/mean"] == one["critic/score/mean"]  # the same rollouts
    assert two["actor/grad_norm"] == pytest.approx(one["actor/grad_norm"], rel=1e-5)
    assert two["critic/grad_norm"] == pytest.approx(one["critic/grad_norm"], rel=1e-5)
    assert two["actor/pg_loss"] == pytest.approx(one["actor/pg_loss"], rel=1e-4, abs=1e-7)
