"""Reproducible runs on the CPU backend (``rollout.full_determinism``, on in the CPU presets): the same config and
seed give bitwise-identical per-step metrics (PPO with a critic and a reference model, two ranks, padding rows, a
token cap: regression for the critic's value head, once drawn from an unseeded RNG); a run SIGKILLed in the middle of a step and restarted with ``trainer.resume_mode=auto``
continues from its last complete checkpoint and reproduces the uninterrupted run's later steps exactly (rollout
seeds, dataloader position, planner seed, LR schedule, both ranks' state)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.runs import DP2_CONFIG, TRAINERS_V0_OPT_IN, dp2_reference, kill_tree, read_metrics, tail

pytestmark = pytest.mark.e2e

VOLATILE = ("timing", "perf", "memory", "time_per", "throughput", "mfu")


def comparable(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not any(w in k for w in VOLATILE) and isinstance(v, (int, float))}


def _start(home: Path, workdir: Path, metrics: Path, ckpt: Path, overrides: list[str]) -> subprocess.Popen:
    env = dict(os.environ, VERL_TRAJ_HOME=str(home.parent), VERL_FILE_LOGGER_PATH=str(metrics), VERL_TRAJ_CKPT_DIR=str(ckpt),
               PYTHONUNBUFFERED="1", RAY_DEDUP_LOGS="0")
    cmd = [sys.executable, "-m", "verl_traj.main_ppo", "--config-name", DP2_CONFIG, "trainer.logger=[console,file]",
           *overrides]
    workdir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 420) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, _ = proc.communicate()
    assert proc.returncode == 0, tail(out, 80)
    return out


def _assert_same_steps(a: list[dict], b: list[dict], steps: list[int]):
    by_step_a, by_step_b = {m["step"]: m for m in a}, {m["step"]: m for m in b}
    for s in steps:
        ca, cb = comparable(by_step_a[s]), comparable(by_step_b[s])
        diff = {k: (ca[k], cb.get(k)) for k in ca if ca[k] != cb.get(k)}
        assert not diff, f"step {s} differs: {dict(list(diff.items())[:6])}"


def _logged_steps(path: Path) -> list[int]:
    """Steps in a metrics file being written: a line still half-written counts as not logged yet."""
    try:
        return [m["step"] for m in read_metrics(path)]
    except json.JSONDecodeError:
        return []


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
    proc = _start(tiny_home, tmp_path / "killed", first, ckpt, save)
    # verl saves a step's checkpoint before it logs the step's metrics: wait for both (regression: CI killed the
    # run between the two and found a step checkpointed but not logged)
    step_1_done = False
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None:
        saved = any(ckpt.rglob("global_step_1/verl_traj_complete"))
        step_1_done = saved and 1 in _logged_steps(first)
        if step_1_done:
            break
        time.sleep(0.05)
    assert step_1_done, "the run never completed its step-1 checkpoint and metrics"
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and everything it started, in the middle of step 2
    kill_tree(proc.pid)
    proc.communicate()
    killed = read_metrics(first)
    assert [m["step"] for m in killed][:1] == [1], killed  # never an empty comparison
    _assert_same_steps(reference, killed, [m["step"] for m in killed])  # same seed -> same metrics
    resumed_path = tmp_path / "resumed.jsonl"
    _finish(_start(tiny_home, tmp_path / "resumed", resumed_path, ckpt, save))
    resumed = read_metrics(resumed_path)
    last_complete = max(int(p.parent.name.split("_")[-1]) for p in ckpt.rglob("verl_traj_complete"))
    assert resumed[0]["step"] >= 2 and [m["step"] for m in resumed] == list(range(resumed[0]["step"], 4))
    assert last_complete == 3
    _assert_same_steps(reference, resumed, [m["step"] for m in resumed])  # exact resume

