"""``python -m verl_traj.summary``: the run's account in words, on hand-written metric rows."""

from verl_traj.core.rollout.length_bias import LengthBudget, Lengths, bias_metrics
from verl_traj.summary import summarize


def _row(**extra):
    return {"traj_plan/trajectories": 8.0, "traj_plan/groups": 2.0, "traj_plan/split_trajectories": 0.0,
            "traj_plan/split_groups": 0.0, "actor/num_optimizer_steps": 2.0, "traj_plan/expected_optimizer_steps": 2.0,
            "traj_plan/micro_batches": 4.0, "actor/micro_batches_per_epoch": 4.0, **extra}


def test_run_equals_planned_and_the_gspo_prepass_is_reported_apart():
    text = summarize([_row(**{"actor/prepass_micro_batches_per_epoch": 1.0, "actor/prepass_skipped_steps": 1.0}),
                      _row(**{"actor/prepass_micro_batches_per_epoch": 2.0, "actor/prepass_skipped_steps": 1.0})])
    assert "- micro-batches: 8 run by the workers, 8 planned" in text
    assert "GSPO trajectory pre-pass: 3 extra no-grad micro-batches per epoch over 2 steps; 2 optimizer steps" in text


def test_no_prepass_line_without_gspo_at_trajectory_scope():
    assert "pre-pass" not in summarize([_row()])


def test_the_reward_is_reported_as_a_trend_and_malformed_tool_calls_as_a_share_per_step():
    rewards = [0.40, 0.50, 0.42, 0.52, 0.55, 0.61, 0.58, 0.60, 0.62, 0.66]
    shares = [0.10, 0.08, 0.05, 0.04, 0.02, 0.0, 0.0, 0.0, 0.01, 0.0]
    text = summarize([_row(**{"traj_reward/mean": r, "traj_agent/malformed_tool_call_share": m})
                      for r, m in zip(rewards, shares)])
    assert "- mean reward per trajectory: 0.440 (steps 1-3) -> 0.627 (steps 8-10), +0.187; moving average of 5 " \
           "steps 0.478 -> 0.614" in text
    assert "10.0% of calls at step 1 -> 0.0% at step 10 (per step: 10% 8% 5% 4% 2% 0% 0% 0% 1% 0%)" in text
    assert "moving average" not in summarize([_row(**{"traj_reward/mean": r}) for r in rewards[:6]])
    assert "malformed" not in summarize([_row(**{"critic/score/mean": 0.5})])


def test_the_plot_and_the_summary_report_the_same_reward(tmp_path, monkeypatch):
    """The quick start's plot showed verl's per-row ``critic/score/mean`` (a trajectory weighed by its rows on v1)
    while its summary reported the per-trajectory reward: both now read ``metrics_log.reward_key``."""
    from verl_traj import plots
    from verl_traj.metrics_log import reward_key

    rows = [{"step": i + 1, "critic/score/mean": 0.9, "traj_reward/mean": 0.1 * i} for i in range(6)]
    assert reward_key(rows) == "traj_reward/mean"
    assert reward_key([{"step": 1, "critic/score/mean": 0.9}]) == "critic/score/mean"
    plotted = []
    monkeypatch.setattr(plots, "moving_average", lambda values, window: plotted.append(values) or values)
    plots.plot_run(rows, tmp_path / "run.png")
    assert plotted == [[0.1 * i for i in range(6)]] and (tmp_path / "run.png").exists()


def _bias(trained: int, cut: int, trained_mean: float, all_mean: float, **shares) -> dict:
    """A step's ``traj_bias/*`` as logged (tokens and turns alike), nothing censored."""
    sums = {f"traj_bias/{m}_{k}": v for m in ("tokens", "turns")
            for k, v in (("mean_ratio", trained_mean / all_mean), ("trained_mean", trained_mean),
                         ("all_mean", all_mean))}
    return _row(**sums, **{"traj_bias/trajectories_trained": float(trained), "traj_bias/trajectories_cut": float(cut),
                           "traj_bias/censored_share": 0.0, "traj_bias/upper_bound_only": 0.0,
                           **{f"traj_bias/{c}_share": v for c, v in shares.items()}})


def test_the_length_bias_is_pooled_over_the_run_with_what_each_cause_let_go():
    """Issue 43: every trajectory of every step counts once (trained means weighted by trajectories trained, means of
    all by all trajectories): 87.5 / 92 = 0.951, where weighting the per-step ratios by trajectories trained read
    0.906; counts per cause from shares."""
    text = summarize([_bias(6, 0, 100.0, 100.0),
                      _bias(2, 2, 50.0, 80.0, stale=0.25, failed_group=0.25)])
    assert ("- length bias over 2 steps, pooled: what trained had 0.951x the mean length (tokens) of all that finished "
            "or was let go, 0.951x in turns (1.0: none; lowest step 0.625); 8 trajectories trained, let go: "
            "failed_group 1, stale 1") in text
    assert "censored" not in text and "upper bound only" not in text
    assert "length bias" not in summarize([_row()])


def test_censored_steps_report_the_bracket_the_censored_share_and_upper_bound_only():
    """A timeout cut two of five at 40 tokens, past every finished length: with a budget of 100 tokens / 10 turns the
    truth lies between 20 / 52 and 20 / 28 (Kaplan-Meier, restricted to the cut), flagged upper bound only; without a
    budget only the upper end, "at most"."""
    trained, cut = Lengths.of([10, 20, 30], [1, 2, 3]), {"timeout": Lengths.of([40, 40], [4, 4])}
    step = bias_metrics(trained, cut, budget=LengthBudget(tokens=100, turns=10))
    text = summarize([_row(**step)])
    assert ("what trained had between 0.385x and 0.714x the mean length (tokens) of all that finished or was let go, "
            "between 0.385x and 0.714x in turns") in text
    assert "let go: timeout 2; censored (stopped early): 40.0% (failed 0.0%, timeout 40.0%)" in text
    assert "; upper bound only in 1 of 1 steps (over 5% of the length distribution past the longest" in text
    assert "what trained had at most 0.714x the mean length" in summarize([_row(**bias_metrics(trained, cut))])


def test_a_log_without_the_per_step_sums_still_reports_its_steps():
    text = summarize([_row(**{"traj_bias/tokens_mean_ratio": 0.8, "traj_bias/trajectories_trained": 2.0,
                              "traj_bias/trajectories_cut": 2.0, "traj_bias/stale_share": 0.5})])
    assert "- length bias: per-step ratios only, not poolable (lowest step 0.800); let go: stale 2" in text


def test_correct_reports_the_lag_the_weights_worst_step_and_the_fallback():
    """Issue 53, item 2: ``traj.stale_groups=correct``'s figures over the run, in words."""
    steps = [_row(**{"traj_offpolicy/lag_max": lag, "traj_offpolicy/lag_p99": lag, "traj_offpolicy/ess": ess,
                     "traj_offpolicy/ess_truncated": 0.9, "traj_offpolicy/log_ratio_m2": m2,
                     "traj_offpolicy/fallback_active": active, "traj_offpolicy/groups_past_cap_dropped_total": 1.0,
                     "traj_staleness/groups_deferred_total": 2.0, "traj_staleness/groups_corrected_total": 3.0})
             for lag, ess, m2, active in ((0, 1.0, 0.0, 0.0), (4, 0.2, 0.05, 1.0), (3, 0.5, 0.01, 1.0))]
    text = summarize(steps)
    assert ("- off-policy (correct): oldest trained token 4 versions old (p99 at most 4); worst step: ESS of the "
            "truncated weights 0.900, mean squared log-ratio 0.050, untruncated ESS 0.200; fallback active 2 of 3 "
            "steps; 3 groups past traj.max_lag dropped, 6 waited for, 9 trained corrected") in text
    assert "off-policy" not in summarize([_row()])
