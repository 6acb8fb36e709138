"""PPO with a critic (GAE) and a reference model (KL loss) end to end through ``python -m verl_traj.main_ppo
--config-name cpu_tiny_ppo`` on a machine without a GPU, at dp=1 and dp=2 (padding rows): critic metrics
every step, the critic stepping on the planned mini-batches with verl_traj's weighted value loss, its own
mini-batch size honoured, and bad critic set-ups refused at start-up by name."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from tests.e2e.runs import BF16, DP2_CONFIG, ONE_RANK_CONFIG, TRAINERS_V0_OPT_IN, dp2_reference, one_rank_ppo, tail

pytestmark = pytest.mark.e2e

STEPS = 3
CRITIC_KEYS = ("critic/vf_loss", "critic/vf_explained_var", "critic/vf_clipfrac", "critic/values/mean",
               "critic/grad_norm", "actor/kl_loss")


def _check(run, *, actor_steps: int, critic_steps: int, n_steps: int = STEPS):
    assert run.returncode == 0, tail(run.output, 80)
    steps = [m for m in run.metrics if "critic/vf_loss" in m]
    assert len(steps) == n_steps, tail(run.output)
    for m in steps:
        assert all(k in m for k in CRITIC_KEYS), sorted(k for k in m if k.startswith("critic/"))
        # the planned path: the critic worker stepped its own mini-batches, each a union of whole groups
        assert m["critic/num_optimizer_steps"] == critic_steps and m["actor/num_optimizer_steps"] == actor_steps
        assert m["critic/micro_batches_per_epoch"] >= 1 and m["traj_plan/split_groups"] == 0
        assert m["critic/grad_norm"] > 0
        # the trainer's loss weights reached both losses: weight x tokens sums to 1 per optimizer step (token-mean).
        # Regression: on v1 the workers read the batch's field list, which did not name loss_weight, so both
        # losses silently fell back to verl's own aggregation (and traj.loss_agg_mode had no effect on v1)
        assert m["actor/loss_weight_mass"] == pytest.approx(1.0, rel=1e-5), m
        assert m["critic/loss_weight_mass"] == pytest.approx(1.0, rel=1e-5), m
    return steps


def test_ppo_one_rank_with_a_larger_critic_mini_batch(shared_run):
    """The shared one-rank run (``one_rank_ppo``): actor mini-batch 4 of 8 prompts, 2 epochs (4 optimizer steps);
    the critic's mini-batch of 8 prompts and 1 epoch are honoured (1 step: the union of the actor's two)."""
    run = shared_run(one_rank_ppo("v1"), config_name=ONE_RANK_CONFIG)
    _check(run, actor_steps=4, critic_steps=1, n_steps=2)


@pytest.mark.parametrize("trainer", TRAINERS_V0_OPT_IN)
def test_ppo_two_ranks_with_padding_and_a_larger_critic_mini_batch(shared_run, trainer):
    """The shared two-rank run (``dp2_reference``): groups of 3 rows, 3 groups per actor mini-batch -> 9 rows -> a
    padding row per mini-batch (2 actor optimizer steps); the critic's mini-batch of 6 prompts is honoured (1 step:
    the union of the actor's two); a token cap."""
    run = shared_run(dp2_reference(trainer), config_name=DP2_CONFIG)
    steps = _check(run, actor_steps=2, critic_steps=1)  # (the value loss falling: the engine test on a fixed batch)
    assert all(m["traj_plan/padding_rows"] > 0 for m in steps)


@pytest.mark.parametrize("override, named", [
    ("critic.model.path=/nonexistent/model", "critic.model.path='/nonexistent/model' does not exist"),
    ("critic.ppo_mini_batch_size=3", "critic.ppo_mini_batch_size=3 does not fit the actor's plan"),
    ("critic.fsdp.ulysses_sequence_parallel_size=2", "critic.fsdp.ulysses_sequence_parallel_size=2 differs"),
])
def test_bad_critic_setups_are_refused_at_start_up(tiny_home, tmp_path, override, named):
    import os

    env = dict(os.environ, VERL_TRAJ_HOME=str(tiny_home.parent))
    run = subprocess.run([sys.executable, "-m", "verl_traj.main_ppo", "--config-name", "cpu_tiny_ppo", override],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and named in run.stdout + run.stderr, (run.stdout + run.stderr)[-3000:]
    assert "Training Progress" not in run.stdout + run.stderr  # refused before anything started


def test_ppo_trains_in_bf16_mixed_precision(run_training):
    """verl's GPU mixed precision on CPU (bf16 compute, fp32 parameters and reductions) for actor, reference and
    critic: PPO trains with the planned mini-batches, its losses and gradients finite. The actor really computes in
    bf16 (its log-probs differ from the fp32 rollout's, where the fp32 runs agree to 1e-8); the per-row loss weights
    stay fp32 (tests/integration/test_loss_precision.py)."""
    run = run_training(one_rank_ppo("v1", steps=2) + BF16, config_name=ONE_RANK_CONFIG, timeout=420)
    _check(run, actor_steps=4, critic_steps=1, n_steps=2)
    for m in (m for m in run.metrics if "critic/vf_loss" in m):
        assert all(math.isfinite(m[k]) for k in ("actor/grad_norm", "critic/grad_norm", "actor/pg_loss", "critic/vf_loss"))
        assert 1e-7 < m["training/rollout_probs_diff_max"] < 1e-2
