"""verl's asynchronous v1 modes through ``python -m verl_traj.main_ppo``: ``colocate_async`` and ``separate_async``.

Each mode runs once as a user's crash would have it: 3 steps with a checkpoint every step, SIGKILLed (the whole
process group) after the checkpoint of its first step in fallback, restarted with ``trainer.resume_mode=auto``. The two runs together serve
every check of the mode:

* generation overlaps training: step 1 is on-policy (rollout vs actor log-probs at rounding level), later steps train
  rows of an older policy with their own rollout log-probs (a gap above rounding); whole units per mini-batch, the
  configured optimizer steps, each group trained in exactly one step;
* ``separate_async`` on CPU: the sync step from verl's rule, a standalone rollout pool, weights synced over gloo every
  step, and the rows of the current policy matching pi_old at rounding level (the sync arrived: ~1e-3 if not);
* resume: the restarted run continues at the step after the last complete checkpoint, verl restores the checkpoint's
  rollouts (finished ones trained once, in-flight ones generated again), and no group trained into the checkpoint is
  trained again (from the planner's dump of every trained row, both runs);
* staleness in tokens per policy version under ``traj.stale_groups=correct`` with ``traj.max_lag=1`` and slow
  sessions (``correct_fallback=defer`` on colocate_async, ``drop`` on separate_async): logged on every step,
  consistent with verl's own version tags, no trained token past the cap, the slow groups waited for (defer) or
  dropped past the cap (drop), ``traj_offpolicy/*`` on every step, the health gate opened by the trainer's own
  statistics and carried through the kill (the exact drop, defer and gate decisions:
  tests/integration/test_v1_group_policies.py).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.runs import finish_run, kill_after_checkpoint, read_metrics, skip_on_accelerator, start_run

pytestmark = pytest.mark.e2e


@dataclass
class KilledAndResumed:
    steps: list[dict]  # steps 1..3: the killed run's up to its last complete checkpoint, then the resumed run's
    saved: int  # the last complete checkpoint when the run was killed
    resumed_from: int  # the first step the resumed run logged
    before: dict[str, set[int]]  # uid -> steps that trained it, in the killed run up to ``saved``
    after: dict[str, set[int]]  # uid -> steps that trained it, in the resumed run
    output: str  # both runs' console output


def _trained_steps(dump: Path, keep=lambda step: True) -> dict[str, set[int]]:
    steps = defaultdict(set)
    for rec in map(json.loads, (dump / "plan.jsonl").read_text().splitlines()):
        for uid, pad in zip(rec["uid"], rec["is_padding"]):
            if not pad and keep(rec["step"]):
                steps[uid].add(rec["step"])
    return dict(steps)


def _killed_and_resumed(home: Path, tmp_path: Path, mode_overrides: list[str], total: int = 3,
                        kill_in_fallback: bool = False) -> KilledAndResumed:
    """``total`` steps, SIGKILLed after the step-1 checkpoint (``kill_in_fallback``: after the first checkpointed step
    before the last whose health gate is open, so the checkpoint holds the open gate), resumed to the end."""
    skip_on_accelerator()
    overrides = [*mode_overrides, f"trainer.total_training_steps={total}", "trainer.save_freq=1",
                 "trainer.resume_mode=auto"]
    kill_when = (lambda m: m["step"] < total and m.get("traj_offpolicy/fallback_active") == 1.0) \
        if kill_in_fallback else None
    ckpt, killed, resumed = tmp_path / "ckpt", tmp_path / "killed.jsonl", tmp_path / "resumed.jsonl"
    first = kill_after_checkpoint(start_run(home, tmp_path / "killed", killed, ckpt, overrides, "cpu_tiny",
                                            extra_env={"VERL_TRAJ_DEBUG_DUMP": str(tmp_path / "dump_killed")}),
                                  ckpt, killed, step=1, when=kill_when)
    saved = max(int(p.parent.name.split("_")[-1]) for p in ckpt.rglob("verl_traj_complete"))
    second = finish_run(start_run(home, tmp_path / "resumed", resumed, ckpt, overrides, "cpu_tiny",
                                  extra_env={"VERL_TRAJ_DEBUG_DUMP": str(tmp_path / "dump_resumed")}))
    after_steps = read_metrics(resumed)
    steps = [m for m in read_metrics(killed) if m["step"] <= saved] + after_steps
    assert [m["step"] for m in steps] == list(range(1, total + 1)), second[-3000:]
    (tmp_path / "output.txt").write_text(first + "\n----- resumed -----\n" + second)  # kept for a failure's reader
    return KilledAndResumed(steps, saved, after_steps[0]["step"],
                            _trained_steps(tmp_path / "dump_killed", lambda s: s <= saved),
                            _trained_steps(tmp_path / "dump_resumed"), first + second)


def _assert_resumed_without_training_twice(run: KilledAndResumed) -> None:
    assert run.resumed_from == run.saved + 1
    assert "training prompt groups from TransferQueue" in run.output  # verl restored the checkpoint's rollouts
    assert run.before and run.after and not set(run.before) & set(run.after)  # nothing trained twice
    for trained in (run.before, run.after):
        assert all(len(steps) == 1 for steps in trained.values())  # each group in exactly one step


def _assert_stale_rows_keep_their_log_probs(steps: list[dict], staleness: str) -> None:
    assert steps[0][staleness] == 0 and steps[0]["training/rollout_probs_diff_max"] < 1e-6  # on-policy
    stale = [m for m in steps[1:] if m[staleness] >= 1]
    assert stale, "no step trained rows of an older policy; the test would not exercise asynchrony"
    assert all(m["training/rollout_probs_diff_max"] > 1e-6 for m in stale)  # their own rollout log-probs


def _assert_token_staleness_within(steps: list[dict], bound: float) -> None:
    """Every step logs its tokens' staleness, within the bound and within verl's worst case per trajectory (versions
    behind at its first token), and the staleness policy's counts."""
    for m in steps:
        assert m["traj_version/token_staleness_max"] <= bound
        assert m["traj_version/token_staleness_max"] <= m["traj_version/staleness_max"]
        assert m["traj_version/token_staleness_mean"] <= m["traj_version/token_staleness_max"]
        assert {"traj_staleness/groups_dropped_total", "traj_staleness/groups_deferred_total"} <= set(m)
        assert 0.0 <= m["traj_bias/tokens_ks"] <= 1.0 and m["traj_bias/tokens_mean_ratio"] > 0  # issue 43: every step
    assert steps[0]["traj_version/current_policy_token_share"] == 1.0  # step 1: all from the initial policy
    assert any(m["traj_version/current_policy_token_share"] < 1.0 for m in steps[1:])


SLOW = "verl_traj.testing.agent_loops.SlowAgentLoop"
OFFPOLICY = ("ess", "ess_truncated", "truncated_share", "truncated_mass", "log_ratio_m2", "lag_max", "lag_p99",
             "fallback_active", "sampled_in_fallback", "groups_past_cap_dropped_total")


def _correct(tmp_path: Path, fallback: str, delay_s: float, every: int) -> list[str]:
    """``traj.stale_groups=correct`` capped at one version, with slow sessions (:class:`SlowAgentLoop`: one group in
    ``every`` finishes ``delay_s`` late, its tokens versions behind). The gate's M2 threshold at 1e-12 opens it at
    the first step with off-policy tokens (any drift passes it), and no later step can hand back (recovery needs half
    of it): the run is in fallback from then on, by the trainer's own statistics."""
    loops = tmp_path / "slow_loops.yaml"
    loops.write_text(f"- name: single_turn_agent\n  _target_: {SLOW}\n  delay_s: {delay_s}\n  every: {every}\n")
    return [f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}", "traj.max_staleness=1",
            "traj.stale_groups=correct", "traj.max_lag=1", f"traj.correct_fallback={fallback}",
            "traj.offpolicy_max_log_ratio_m2=1e-12", "algorithm.rollout_correction.rollout_is=token"]


def _assert_bounded_and_resumed_in_fallback(run: KilledAndResumed, fallback: str) -> None:
    """Issue 53, item 6: every step logs ``traj_offpolicy/*``, no trained token is past the cap; the gate opened on the
    first off-policy step and stayed open; the run killed in fallback resumed in fallback, saying so (its first step
    sampled with the gate open, as the uninterrupted run's next step is: the gate came back with the checkpoint)."""
    for m in run.steps:
        assert {f"traj_offpolicy/{k}" for k in OFFPOLICY} <= set(m), sorted(k for k in m if "offpolicy" in k)
        assert m["traj_offpolicy/lag_max"] <= 1 and m["traj_offpolicy/lag_p99"] <= 1
    off = [m for m in run.steps if m["traj_offpolicy/lag_max"] >= 1]
    assert off and off[0]["traj_offpolicy/fallback_active"] == 1.0 and off[0]["traj_offpolicy/log_ratio_m2"] > 1e-12
    assert all(m["traj_offpolicy/fallback_active"] == 1.0 for m in run.steps if m["step"] >= off[0]["step"])
    assert f"traj.stale_groups=correct resumes in fallback (traj.correct_fallback={fallback})" in run.output
    assert run.steps[run.saved - 1]["traj_offpolicy/fallback_active"] == 1.0  # killed in fallback
    assert all(m["traj_offpolicy/sampled_in_fallback"] == 1.0 for m in run.steps[run.saved:])
    assert any("traj_bias/tokens_mean_ratio_weighted" in m for m in off)


def test_colocate_async_trains_whole_units_and_resumes_after_sigkill(tiny_home, tmp_path):
    """``correct`` with ``defer``: the slow groups are waited for at the cap, never dropped."""
    run = _killed_and_resumed(tiny_home, tmp_path, ["trainer.v1.trainer_mode=colocate_async",
                                                    *_correct(tmp_path, "defer", delay_s=15, every=3)],
                              kill_in_fallback=True)
    for m in run.steps:
        assert m["actor/num_optimizer_steps"] == 2 and m["traj_plan/split_groups"] == 0
        assert m["traj_plan/split_trajectories"] == 0
        assert m["traj_staleness/groups_dropped_total"] == 0
    assert sum(m["traj_staleness/groups_deferred_total"] for m in run.steps) > 0
    _assert_stale_rows_keep_their_log_probs(run.steps, "training/off_policy/trajectory_staleness/max")
    _assert_token_staleness_within(run.steps, 1.0)
    _assert_bounded_and_resumed_in_fallback(run, "defer")
    _assert_resumed_without_training_twice(run)


def test_separate_async_trains_on_cpu_with_gloo_weight_sync_and_resumes_after_sigkill(tiny_home, tmp_path):
    """Half a batch of warm-up makes every step mix rows of the previous policy with rows of the current one, so the
    sync check has rows to read on every step. The user's plain override (verl's warm-up of one batch) trains end to
    end in ``test_failed_rollouts.py::test_separate_async_times_out_hanging_sessions_and_drops_their_groups``.
    ``correct`` with ``drop``: slow groups pass the cap and are dropped (and refilled)."""
    run = _killed_and_resumed(tiny_home, tmp_path, ["trainer.v1.trainer_mode=separate_async",
                                                    "trainer.v1.separate_async.num_warmup_batches=0.5",
                                                    *_correct(tmp_path, "drop", delay_s=20, every=6)], total=5,
                                kill_in_fallback=True)
    assert "separate_async.parameter_sync_step=2" in run.output and "checkpoint_engine.backend=gloo" in run.output
    for m in run.steps:
        assert m["actor/num_optimizer_steps"] == 1 and m["traj_plan/split_groups"] == 0  # one mini-batch per update
        assert m["actor/micro_batches_per_epoch"] == m["traj_plan/micro_batches"]  # run = planned
        assert m["weight_sync/gloo_megabytes"] > 0
        assert m.get("traj_version/current_policy_probs_diff_max", 0.0) < 1e-6  # every sync arrived
    assert all(m["traj_version/current_policy_rows"] > 0 for m in run.steps[:run.saved])
    assert sum(m.get("traj_version/current_policy_rows", 0) for m in run.steps[1:]) > 0  # checked after a sync
    assert sum(m["traj_offpolicy/groups_past_cap_dropped_total"] for m in run.steps) > 0  # passed the cap: dropped
    _assert_stale_rows_keep_their_log_probs(run.steps, "traj_version/staleness_max")
    _assert_token_staleness_within(run.steps, 1.0)
    _assert_bounded_and_resumed_in_fallback(run, "drop")
    _assert_resumed_without_training_twice(run)
