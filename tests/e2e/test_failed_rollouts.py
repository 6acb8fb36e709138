"""Failed rollouts through ``python -m verl_traj.main_ppo`` on every v1 mode, with failures injected by
:class:`verl_traj.testing.agent_loops.FailingAgentLoop` (the same sessions in every run: prompt uids are seeded):
session 1 of about half the groups, and every session of about a fifth, crash like a tool (``fail: raise``) or hang
(``fail: hang``) until ``traj.trajectory_timeout_s`` ends them. Training never crashes and runs its steps; the
failures and their reasons are logged every step (``traj_failure/*``); the dump of every planned row shows what was
trained: under ``traj.failed_groups=drop`` only whole groups without a failed session, under ``keep_survivors`` the
finished sessions of a group and never a group without one."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from tests.e2e.runs import tail
from verl_traj.testing.agent_loops import injected_failure

pytestmark = pytest.mark.e2e

N = 4  # rollout.n of cpu_tiny
LOOP = "verl_traj.testing.agent_loops.FailingAgentLoop"


def _run(run_training, tmp_path, fail: str, overrides: list[str]):
    loops = tmp_path / "failing_loops.yaml"
    loops.write_text(f"- name: single_turn_agent\n  _target_: {LOOP}\n  fail: {fail}\n")
    dump = tmp_path / "dump"
    run = run_training([f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
                        "trainer.total_training_steps=3", *overrides],
                       timeout=600, extra_env={"VERL_TRAJ_DEBUG_DUMP": str(dump)})
    assert run.returncode == 0, tail(run.output, 80)
    steps = [m for m in run.metrics if "actor/num_optimizer_steps" in m]
    assert len(steps) == 3, tail(run.output)
    rows = Counter()  # real rows trained per group
    for rec in map(json.loads, (dump / "plan.jsonl").read_text().splitlines()):
        rows.update(uid for uid, pad in zip(rec["uid"], rec["is_padding"]) if not pad)
    return steps, rows


def _failed_sessions(uid: str) -> int:
    return sum(injected_failure(uid, s) for s in range(N))


CORRECT = ["traj.max_staleness=1", "traj.stale_groups=correct", "algorithm.rollout_correction.rollout_is=token"]


def _corrected_every_step(steps) -> None:
    """``traj.stale_groups=correct``: counted every step, never a staleness drop, verl's importance weights on."""
    for m in steps:
        assert m["traj_staleness/groups_dropped_total"] == 0 and "traj_staleness/groups_corrected_total" in m
        assert m.get("training/off_policy/evicted_samples", 0) == 0  # verl's own drop turned off
        assert any(key.startswith("rollout_corr/") for key in m), sorted(m)


def _logged_every_step(steps, reason: str) -> None:
    for m in steps:
        assert m["traj_failure/trajectories_failed_total"] == m[f"traj_failure/reason_total/{reason}"] > 0
        assert 0.0 <= m["traj_bias/tokens_ks"] <= 1.0 and m["traj_bias/trajectories_trained"] > 0  # issue 43
    assert sum(m["traj_failure/groups_dropped_total"] for m in steps) > 0
    cause = "timeout" if reason == "timeout" else "failed"  # the length bias counts what the failures cut
    assert sum(m.get(f"traj_bias/{cause}_share", 0.0) for m in steps) > 0


def test_sync_drops_each_failed_group_whole_and_refills_the_batch(run_training, tmp_path):
    steps, rows = _run(run_training, tmp_path, "raise", [])
    _logged_every_step(steps, "InjectedToolCrash")
    for m in steps:
        assert m["traj_failure/groups_kept_total"] == 0 and m["traj_plan/groups"] == 8  # refilled to full size
    assert rows and all(n == N and _failed_sessions(uid) == 0 for uid, n in rows.items())


def test_colocate_async_keeps_survivors_when_asked_and_never_an_empty_group(run_training, tmp_path):
    """Also issue 43's bias-free pair: ``keep_survivors`` (at least two survivors, the baseline over them) and
    ``traj.stale_groups=correct`` (nothing dropped for staleness; stale tokens under verl's token IS weights)."""
    steps, rows = _run(run_training, tmp_path, "raise",
                       ["trainer.v1.trainer_mode=colocate_async", "traj.failed_groups=keep_survivors", *CORRECT])
    _logged_every_step(steps, "InjectedToolCrash")
    assert sum(m["traj_failure/groups_kept_total"] for m in steps) > 0
    assert all(m["actor/num_optimizer_steps"] == 2 for m in steps)
    assert all(n == N - _failed_sessions(uid) >= 2 for uid, n in rows.items())  # the survivors, all of them
    assert any(n < N for n in rows.values())  # some group trained on its survivors
    _corrected_every_step(steps)


def test_separate_async_times_out_hanging_sessions_and_drops_their_groups(run_training, tmp_path):
    """With ``traj.stale_groups=correct`` too (issue 43): the failed groups drop, the stale ones train."""
    steps, rows = _run(run_training, tmp_path, "hang",
                       ["trainer.v1.trainer_mode=separate_async", "traj.trajectory_timeout_s=4", *CORRECT])
    _logged_every_step(steps, "timeout")
    _corrected_every_step(steps)
    assert rows and all(n == N and _failed_sessions(uid) == 0 for uid, n in rows.items())
