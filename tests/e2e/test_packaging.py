"""The package as a user installs it: ``python -m build`` makes a wheel (SPDX licence, no setuptools warning)
that carries the configs, presets and recipes, and trains from outside the checkout."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.e2e.runs import read_metrics, tail

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


def test_installed_wheel_trains_outside_the_checkout(wheel, tiny_home, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    metrics = tmp_path / "metrics.jsonl"
    env = dict(os.environ, PYTHONPATH=str(site), VERL_TRAJ_HOME=str(tiny_home), VERL_FILE_LOGGER_PATH=str(metrics))
    probe = subprocess.run([sys.executable, "-c", "import verl_traj; print(verl_traj.__file__)"], cwd=elsewhere,
                           env=env, capture_output=True, text=True, check=True)
    assert probe.stdout.startswith(str(site))  # the wheel's copy, not the checkout
    run = subprocess.run([sys.executable, "-m", "verl_traj.main_ppo", "--config-name", "cpu_tiny",
                          "trainer.total_training_steps=1", "trainer.logger=[console,file]"],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=420)
    assert run.returncode == 0, tail(run.stdout + run.stderr, 60)
    assert len(read_metrics(metrics)) == 1
