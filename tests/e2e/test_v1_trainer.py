"""verl's v1 trainer beyond what ``test_traj_training`` checks on both trainers: the gradient's independence of the
data-parallel layout on the v1 path (TransferQueue, padding rows, dispatch). The asynchronous modes:
``test_async_modes.py``."""

from __future__ import annotations

import pytest

from tests.e2e.runs import DP2_CAP, DP2_CONFIG, ULYSSES_2, dp2_reference, tail

pytestmark = pytest.mark.e2e


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
