"""The package as a user installs it: ``python -m build`` makes a wheel (SPDX licence, no setuptools warning)
that carries the configs, presets and recipes, and runs the README's first command, the quick start (the
calculator agent with step-wise rows and prefix merging), from outside the checkout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.e2e.runs import tail

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    run = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(REPO)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert "deprecated" not in (run.stdout + run.stderr).lower()
    return next(out.glob("verl_traj-*.whl"))


def test_wheel_carries_configs_presets_and_recipes(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for preset in ("quickstart", "cpu_tiny", "cpu_tiny_ppo", "calc_agent_cpu", "calc_agent_gpu", "traj_ppo"):
        assert f"verl_traj/configs/{preset}.yaml" in names
    for group in ("traj/default", "platform/cpu", "task/tiny_digits", "task/calc_agent_cpu", "agent_loops/stepwise"):
        assert f"verl_traj/configs/{group}.yaml" in names
    assert "verl_traj/recipes/calc_agent/tool.py" in names
    metadata = next(n for n in names if n.endswith("/METADATA"))
    assert "License-Expression: Apache-2.0" in zipfile.ZipFile(wheel).read(metadata).decode()


STEPS = 2


def _installed(wheel: Path, tmp_path: Path, home: Path) -> tuple[dict, Path]:
    """The wheel installed into ``tmp_path/site`` (no dependencies: they are this venv's) and an environment that
    imports it from there; returns (env, a directory outside the checkout)."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site), VERL_TRAJ_HOME=str(home), VERL_TRAJ_OUT=str(tmp_path / "out"),
               VERL_TRAJ_CKPT_DIR=str(tmp_path / "ckpt"))
    probe = subprocess.run([sys.executable, "-c", "import verl_traj; print(verl_traj.__file__)"], cwd=elsewhere,
                           env=env, capture_output=True, text=True, check=True)
    assert probe.stdout.startswith(str(site))  # the wheel's copy, not the checkout
    return env, elsewhere


def test_quickstart_from_the_installed_wheel_outside_the_checkout(wheel, recipe_home, tmp_path):
    """``python -m verl_traj.quickstart`` (the README's first command, after install) from the wheel: the prepared
    recipe, step-wise rows with prefix merging, a summary of what verl_traj did and a plot."""
    env, elsewhere = _installed(wheel, tmp_path, recipe_home)
    run = subprocess.run([sys.executable, "-m", "verl_traj.quickstart", f"trainer.total_training_steps={STEPS}",
                          "actor_rollout_ref.rollout.temperature=0.7"], cwd=elsewhere, env=env, capture_output=True,
                         text=True, timeout=900)
    out = run.stdout + run.stderr
    assert run.returncode == 0, tail(out, 80)
    summary = out[out.index("verl_traj summary"):]
    assert f"{STEPS} training steps" in summary and "every one kept whole in one mini-batch" in summary
    assert "LLM calls became" in summary and "by prefix merging" in summary
    assert "optimizer steps per training step: [4] (as configured" in summary
    assert (tmp_path / "out" / "run.png").exists()
    metrics = [json.loads(line)["data"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    assert len(metrics) == STEPS
    for m in metrics:
        assert m["num_turns/mean"] > 2.0  # the tool loop ran: assistant and tool turns beyond one reply
        # step rows, prefix-merged on the v1 agent-loop worker, reproduce what the rollout generated token for token
        assert m["training/rollout_probs_diff_max"] < 1e-4
        assert m["traj_stepwise/rows_after"] <= m["traj_stepwise/rows_before"]
        assert m["traj_stepwise/tokens_after"] <= m["traj_stepwise/tokens_before"]
        assert m["traj_plan/real_rows"] == m["traj_stepwise/rows_after"]
        assert m["traj_stepwise/loss_tokens"] == m["traj_plan/loss_tokens"]
        assert m["traj_plan/split_trajectories"] == 0 and m["traj_plan/split_groups"] == 0
    assert any(m["traj_stepwise/rows_after"] < m["traj_stepwise/rows_before"] for m in metrics)  # merging happened
