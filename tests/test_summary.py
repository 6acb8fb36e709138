"""``python -m verl_traj.summary``: the run's account in words, on hand-written metric rows."""

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
