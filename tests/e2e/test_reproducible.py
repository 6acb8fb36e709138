"""Reproducible runs on the CPU backend (``rollout.full_determinism``, on in the CPU presets): the same config and
seed give bitwise-identical per-step metrics (PPO with a critic and a reference model, two ranks, padding rows, a
token cap: regression for the critic's value head, once drawn from an unseeded RNG); a run SIGKILLed in the middle of a step and restarted with ``trainer.resume_mode=auto``
continues from its last complete checkpoint and reproduces the uninterrupted run's later steps exactly (rollout
seeds, dataloader position, planner seed, LR schedule, both ranks' state)."""

from __future__ import annotations

import pytest

from tests.e2e.runs import (DP2_CONFIG, TRAINERS_V0_OPT_IN, dp2_reference, finish_run, kill_after_checkpoint,
                            read_metrics, start_run)

pytestmark = pytest.mark.e2e

VOLATILE = ("timing", "perf", "memory", "time_per", "throughput", "mfu", "busy_share")


def comparable(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not any(w in k for w in VOLATILE) and isinstance(v, (int, float))}


def _assert_same_steps(a: list[dict], b: list[dict], steps: list[int]):
    by_step_a, by_step_b = {m["step"]: m for m in a}, {m["step"]: m for m in b}
    for s in steps:
        ca, cb = comparable(by_step_a[s]), comparable(by_step_b[s])
        diff = {k: (ca[k], cb.get(k)) for k in ca if ca[k] != cb.get(k)}
        assert not diff, f"step {s} differs: {dict(list(diff.items())[:6])}"


@pytest.mark.parametrize("trainer", TRAINERS_V0_OPT_IN)
def test_same_seed_same_metrics_and_exact_resume_after_sigkill(shared_run, tiny_home, tmp_path, trainer):
    steps = dp2_reference(trainer)
    uninterrupted = shared_run(steps, config_name=DP2_CONFIG)
    assert uninterrupted.returncode == 0, uninterrupted.tail(80)
    reference = uninterrupted.metrics
    assert [m["step"] for m in reference] == [1, 2, 3]
    assert all(m["traj_plan/padding_rows"] > 0 for m in reference)  # two ranks, padding rows every step
    assert {"critic/vf_loss", "critic/values/mean"} <= set(comparable(reference[0]))  # the critic is compared too
    ckpt = tmp_path / "ckpt"
    save = [*steps, "trainer.save_freq=1", "trainer.resume_mode=auto"]
    first = tmp_path / "killed.jsonl"
    proc = start_run(tiny_home, tmp_path / "killed", first, ckpt, save, DP2_CONFIG)
    kill_after_checkpoint(proc, ckpt, first, step=1)  # the driver and everything it started, in step 2
    killed = read_metrics(first)
    assert [m["step"] for m in killed][:1] == [1], killed  # never an empty comparison
    _assert_same_steps(reference, killed, [m["step"] for m in killed])  # same seed -> same metrics
    resumed_path = tmp_path / "resumed.jsonl"
    finish_run(start_run(tiny_home, tmp_path / "resumed", resumed_path, ckpt, save, DP2_CONFIG))
    resumed = read_metrics(resumed_path)
    last_complete = max(int(p.parent.name.split("_")[-1]) for p in ckpt.rglob("verl_traj_complete"))
    assert resumed[0]["step"] >= 2 and [m["step"] for m in resumed] == list(range(resumed[0]["step"], 4))
    assert last_complete == 3
    _assert_same_steps(reference, resumed, [m["step"] for m in resumed])  # exact resume

