"""Real verl CPU GRPO training (Ray, FSDP2 workers, CPU rollout server, verl's tool agent loop) with
step-wise rows: StepwiseToolAgentLoop records every LLM call, the step rows are built (and optionally
prefix-merged) from them -- by the v1 agent-loop worker or the v0 trainer's _balance_batch -- the planner keeps trajectories whole, advantages are per
trajectory. Evidence that step rows are built right: the actor's recomputed log-probs on the step
rows match the rollout's own log-probs token for token (``training/rollout_probs_diff_max``)."""

import json

import pytest

from tests.e2e.runs import TRAINERS_V0_OPT_IN, run_stepwise

pytestmark = pytest.mark.e2e
STEPS = 2


TURN_REWARD_LOOP = "verl_traj.testing.agent_loops.TurnRewardToolAgentLoop"


# v1 with prefix merging is the quick start's configuration: tests/e2e/test_packaging.py runs it
@pytest.mark.parametrize("trainer, merge", [("v1", False), ("v0", False)])
def test_stepwise_training_on_cpu(tool_home, tmp_path, trainer, merge):
    """v1: the agent-loop worker stores each session's step rows; v0: the trainer expands them (both merge
    with traj.merge_prefix). The loop gives every LLM call a turn reward (:class:`~verl_traj.testing.agent_loops.
    TurnRewardToolAgentLoop`): each reaches the trainer, one per LLM call, on both trainers. The estimator is GiGPO
    (``algorithm.adv_estimator=gigpo``, step groups by anchor state): every LLM call lands in one step group (the
    calls behind a GRPO group's shared prompt in one of four), and its advantage trains."""
    from verl_traj.testing.agent_loops import TURN_REWARD

    metrics, out = run_stepwise(tool_home, tmp_path, trainer, merge, loop=TURN_REWARD_LOOP,
                                 extra=("algorithm.adv_estimator=gigpo", "algorithm.gamma=0.95"))
    keys = [k for k in metrics[0] if k.startswith(("traj_stepwise/", "traj_plan/", "traj_gigpo/", "actor/",
                                                  "training/rollout_probs"))]
    summary = json.dumps([{k: m.get(k) for k in keys} for m in metrics], default=str)
    try:
        _check(metrics, merge)
        for m in metrics:  # one turn reward per LLM call (a step row before merging), none lost or doubled
            assert m["traj_stepwise/turn_rewards_nonzero"] == m["traj_stepwise/rows_before"]
            assert m["traj_stepwise/turn_reward_sum"] == TURN_REWARD * m["traj_stepwise/rows_before"]
            # GiGPO: every call in one step group; each GRPO group's first calls (its shared prompt) share one
            groups, shared = m["traj_gigpo/step_groups"], m["traj_gigpo/steps_in_shared_groups"]
            assert 8 <= groups <= m["traj_stepwise/rows_before"] - 24, summary  # 8 prompts x 4 first calls
            assert shared >= 32 / m["traj_stepwise/rows_before"] and 0 < m["traj_gigpo/step_adv_share"] < 1
            assert m["traj_gigpo/step_group_size_mean"] == pytest.approx(m["traj_stepwise/rows_before"] / groups)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nmetrics: {summary}\nlog tail: {out[-4000:]}") from exc


CREDIT_KEYS = ("critic/advantages/mean", "critic/advantages/max", "critic/advantages/min", "critic/returns/mean",
               "critic/returns/max", "critic/returns/min", "critic/values/mean")


@pytest.mark.parametrize("trainer", TRAINERS_V0_OPT_IN)
def test_ppo_with_gae_across_turns_on_step_rows(tool_home, tmp_path, trainer):
    """PPO with a critic on step rows, GAE across each trajectory's rows: unmerged (one row per LLM call) and
    prefix-merged (one row per trajectory) train, and on step 1 (the same rollouts, the same seeded critic) both give
    the same advantages and returns on the same loss tokens (verl's metrics over them agree), which they could not if
    a turn's credit stopped at its row's edge. v0 (opt-in): the same through its expansion, on two ranks."""
    runs = {merge: run_stepwise(tool_home, tmp_path / f"merge_{merge}", trainer, merge, config_name="cpu_tiny_ppo",
                                 steps=1, extra=("algorithm.gamma=0.95",))[0][0] for merge in (False, True)}
    unmerged, merged = runs[False], runs[True]
    assert unmerged["traj_stepwise/rows_after"] > unmerged["traj_stepwise/trajectories"]  # several rows a trajectory
    assert merged["traj_stepwise/rows_after"] == merged["traj_stepwise/trajectories"]
    # the same rollouts: the same loss tokens (v1's per-row critic/score/* would weigh a trajectory by its rows)
    assert unmerged["traj_stepwise/loss_tokens"] == merged["traj_stepwise/loss_tokens"]
    assert unmerged["traj_stepwise/tokens_before"] == merged["traj_stepwise/tokens_before"]
    for m in runs.values():
        assert m["critic/vf_loss"] > 0 and m["critic/grad_norm"] > 0 and m["actor/grad_norm"] > 0
    for key in CREDIT_KEYS:
        assert unmerged[key] == pytest.approx(merged[key], rel=1e-4, abs=1e-5), key


def test_trajectory_ratios_in_colocate_async_on_step_rows(tool_home, tmp_path):
    """Asynchronous training (v1 ``colocate_async``) on unmerged step rows with verl's rollout correction
    (``rollout_is=sequence``, geometric-mean rejection ``seq_mean_k1``) and GSPO at ``traj.ratio_scope=trajectory``: every step logs ``traj_ratio/*`` over the 32 trajectories; on step 1 (on-policy) every trajectory
    weight is 1; rows one policy version old get trajectory weights != 1, each the product of its rows' weights
    (``max_abs_row_gap``); GSPO's ratio is summed over each trajectory's rows every optimizer step (the shift is
    logged; on the default path, prefix trees, in the loss); the versions are reported per trajectory; training
    proceeds."""
    metrics, out = run_stepwise(tool_home, tmp_path, "v1", False, steps=3, extra=(
        "trainer.v1.trainer_mode=colocate_async", "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
        "traj.ratio_scope=trajectory",
        "algorithm.rollout_correction.rollout_is=sequence",
        "algorithm.rollout_correction.rollout_is_threshold=2.0", "algorithm.rollout_correction.rollout_rs=seq_mean_k1",
        "algorithm.rollout_correction.rollout_rs_threshold='0.5_2.0'"))
    shown = ("traj_ratio/", "traj_version/", "traj_stepwise/")
    summary = json.dumps([{k: v for k, v in m.items() if k.startswith(shown) or "prepass" in k} for m in metrics])
    for m in metrics:
        assert m["traj_ratio/trajectories"] == 32, summary
        # a trajectory may be generated across two policy versions (partial rollout, timing-dependent): reported
        assert m["traj_version/span_max"] >= 1 and (m["traj_version/span_max"] > 1) == (
            m["traj_version/multi_version_share"] > 0), summary
        assert m["traj_ratio/max_abs_row_gap"] < 1e-3, summary  # the trajectory weight = the product of its rows'
        assert m["actor/grad_norm"] > 0 and m["actor/loss_weight_mass"] == pytest.approx(1.0), summary
        # GSPO's trajectory ratio, on the default path (prefix trees: every trajectory in one micro-batch): taken in
        # the loss from the live log-probs, no pre-pass; only in a step where some trajectory has several rows (an
        # asynchronous step may take only one-call trajectories: then there is no trajectory ratio to sum). On rows,
        # the pre-pass: test_gspo_over_the_trajectory_on_step_rows_equals_the_merged_row
        multi = m["traj_stepwise/rows_after"] > m["traj_stepwise/trajectories"]
        assert ("actor/ratio_in_loss" in m) == multi and m["actor/tree_share"] == 1.0, summary
        assert not multi or (m["actor/ratio_in_loss"] == 1.0 and m["actor/prepass_micro_batches_per_epoch"] == 0), summary
        assert m["actor/micro_batches_per_epoch"] == m["traj_plan/micro_batches"], summary
    assert any(m["traj_stepwise/rows_after"] > m["traj_stepwise/trajectories"] for m in metrics), summary
    first = metrics[0]
    assert first["traj_version/staleness_max"] == 0, summary
    assert abs(first["traj_ratio/weight_min"] - 1) < 1e-3 and abs(first["traj_ratio/weight_max"] - 1) < 1e-3, summary
    stale = [m for m in metrics[1:] if m["traj_version/staleness_max"] >= 1]
    assert stale, f"no step trained rows of an older policy; the test would not exercise asynchrony: {summary}"
    assert all(abs(m["traj_ratio/weight_mean"] - 1) > 1e-3 for m in stale), summary


def test_gspo_over_the_trajectory_on_step_rows_equals_the_merged_row(gspo_step_rows):
    """GSPO (its sequence ratio from the current policy) on unmerged step rows at ``traj.ratio_scope=trajectory``, on
    the row forward (``traj.prefix_tree=false``, where a trajectory's rows may sit in several micro-batches): before
    each optimizer step the actor sums every trajectory's log-ratios over its rows, so one mini-batch trained for two
    epochs (the second epoch off pi_old) gives the same gradients and loss as the same rollouts with every trajectory
    prefix-merged into one row (whose row is the trajectory; on the default path). The first optimizer step
    (on-policy: every log-ratio is rounding) skips the pre-pass; the second runs it, counted apart from the planned
    micro-batches, and shifts the rows' ratios (per-row ratios would have differed there). Merged, no trajectory has
    several rows: no ratio groups, no pre-pass. (On trees every trajectory is one micro-batch and the loss takes its
    ratio without a pre-pass: tests/e2e/test_prefix_tree_training.py.)"""
    unmerged, merged = gspo_step_rows(False, "false"), gspo_step_rows(True)
    assert unmerged["traj_stepwise/rows_after"] > unmerged["traj_stepwise/trajectories"]
    assert unmerged["traj_stepwise/loss_tokens"] == merged["traj_stepwise/loss_tokens"]  # the same rollouts
    assert unmerged["actor/num_optimizer_steps"] == merged["actor/num_optimizer_steps"] == 2
    assert unmerged["actor/traj_seq_ratio_shift_abs_max"] > 1e-4  # step 2: the trajectory's ratio is not a row's
    assert unmerged["actor/prepass_skipped_steps"] == 1  # step 1
    # one pre-pass over the one mini-batch in 2 epochs, apart from the planned micro-batches (run = planned)
    assert unmerged["actor/prepass_micro_batches_per_epoch"] == unmerged["traj_plan/micro_batches"] / 2
    assert unmerged["actor/micro_batches_per_epoch"] == unmerged["traj_plan/micro_batches"]
    assert "actor/traj_seq_ratio_shift_abs_max" not in merged and "actor/prepass_skipped_steps" not in merged
    assert unmerged["actor/grad_norm"] == pytest.approx(merged["actor/grad_norm"], rel=1e-4)
    assert unmerged["actor/pg_loss"] == pytest.approx(merged["actor/pg_loss"], rel=1e-4, abs=1e-7)


def _check(metrics, merge):
    saw_multi_step = False
    for m in metrics:
        trajectories = m["traj_stepwise/trajectories"]
        assert trajectories == 8 * 4  # train_batch_size x rollout.n: one trajectory per rollout
        assert m["traj_stepwise/rows_before"] >= trajectories
        saw_multi_step |= m["traj_stepwise/rows_before"] > trajectories
        assert m["traj_plan/real_rows"] == m["traj_stepwise/rows_after"]
        assert m["traj_plan/trajectories"] == trajectories
        assert m["traj_plan/split_trajectories"] == 0 and m["traj_plan/split_groups"] == 0
        assert m["traj_stepwise/loss_tokens"] == m["traj_plan/loss_tokens"]
        if merge:
            # verl's tool loop is token-in/token-out: every trajectory merges back into one row
            assert m["traj_stepwise/rows_after"] == trajectories
            assert m["traj_stepwise/tokens_after"] <= m["traj_stepwise/tokens_before"]
        else:
            assert m["traj_stepwise/rows_after"] == m["traj_stepwise/rows_before"]
        assert m["actor/num_optimizer_steps"] == 2  # train_batch_size / ppo_mini_batch_size, whatever the turns
        assert m["actor/grad_norm"] > 0
        # the step rows reproduce what the rollout generated, at the right positions
        assert m["training/rollout_probs_diff_max"] < 1e-4
    assert saw_multi_step, "no trajectory had more than one LLM call; the test would not exercise step rows"
    # verl's tool loop ran: user + assistant = 2 turns; a tool round trip adds a tool and an assistant turn
    assert max(m["num_turns/max"] for m in metrics) >= 4
