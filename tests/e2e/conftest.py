"""Shared fixtures for the CPU end-to-end tests (real verl training through verl_traj.main_ppo).

* ``tiny_home`` (``tests/conftest.py``): the tiny model/tokenizer/data, built once per session (offline).
* ``run_training``: runs ``python -m verl_traj.main_ppo`` in a subprocess with a timeout, samples
  the summed RSS of the whole process tree (driver, Ray daemons, workers, rollout servers) and
  returns the logged metrics (verl's ``file`` logger, JSONL) and the peak memory.
* ``shared_run``: the same, launched once per session for every test asking for the same overrides.
* ``recipe_home``: the calculator-agent recipe prepared offline once per session (short warm start).
* ``gspo_step_rows``: step 1 of GSPO at trajectory scope on step rows, launched once per (merging, prefix tree).

The pieces (:func:`tests.e2e.runs.launch`, the override sets) are in ``tests/e2e/runs.py``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.runs import TrainingRun, launch, run_stepwise, skip_on_accelerator


@pytest.fixture
def run_training(tiny_home, tmp_path):
    """A training run of this test's own (see :func:`launch`), in the test's ``tmp_path``."""
    skip_on_accelerator()

    def _run(overrides: list[str], **kwargs) -> TrainingRun:
        return launch(tiny_home, tmp_path, overrides, **kwargs)

    return _run


@pytest.fixture(scope="session")
def shared_run(tiny_home, tmp_path_factory):
    """A training run shared by every test that asks for the same config and overrides: each run costs a minute
    or more of start-up on CI's two cores, so tests that observe the same run (e.g. reproducibility and gradient
    equivalence on the same dp=2 batch) launch it once. Tests must only read the returned run. The trainer's debug
    dump (``VERL_TRAJ_DEBUG_DUMP``: every row's ids per step) is written to ``run.workdir / "dump"``."""
    cache: dict = {}

    def _get(overrides: list[str], config_name: str = "cpu_tiny", timeout: float = 480) -> TrainingRun:
        skip_on_accelerator()
        key = (config_name, tuple(overrides))
        if key not in cache:
            workdir = tmp_path_factory.mktemp("shared_run")
            cache[key] = launch(tiny_home, workdir, list(overrides), timeout=timeout, config_name=config_name,
                                extra_env={"VERL_TRAJ_DEBUG_DUMP": str(workdir / "dump")})
        return cache[key]

    return _get


@pytest.fixture(scope="session")
def recipe_home(tmp_path_factory) -> Path:
    """``$VERL_TRAJ_HOME`` with the calculator-agent recipe prepared (data, tiny model, a short warm start: enough to
    make the tool-call format likely; the long one is the recipe's). ``--eval-samples 4`` still runs prepare's
    offline evaluation (evaluate.py) on the warm-started model."""
    home = tmp_path_factory.mktemp("calc_recipe")
    cmd = [sys.executable, "-m", "verl_traj.recipes.calc_agent.prepare", "--home", str(home / "calc_agent"),
           "--sft-steps", "80", "--n-train", "64", "--n-test", "8", "--eval-samples", "4"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    return home


# GSPO's sequence ratio over each trajectory's step rows, one mini-batch of the 8 prompts trained for two epochs (the
# second off pi_old: the trajectory's ratio is not a row's), trajectories kept whole
GSPO_TWO_EPOCHS = ("actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "traj.ratio_scope=trajectory",
                   "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_epochs=2",
                   "traj.group_by=trajectory")


@pytest.fixture(scope="session")
def gspo_step_rows(tool_home, tmp_path_factory):
    """Step 1's metrics of a one-step v1 run of :data:`GSPO_TWO_EPOCHS` on step rows: ``get(merge, prefix_tree)``
    (``prefix_tree="auto"``, the default: trees on the CPU presets), launched once per pair for every test reading it
    (the GSPO-over-the-trajectory check reads unmerged rows and merged; the tree check unmerged trees and rows)."""
    cache: dict = {}

    def _get(merge: bool, prefix_tree: str = "auto") -> dict:
        skip_on_accelerator()
        if (merge, prefix_tree) not in cache:
            extra = GSPO_TWO_EPOCHS + (() if prefix_tree == "auto" else (f"traj.prefix_tree={prefix_tree}",))
            workdir = tmp_path_factory.mktemp(f"gspo_merge_{merge}_{prefix_tree}")
            cache[(merge, prefix_tree)] = run_stepwise(tool_home, workdir, "v1", merge, steps=1, extra=extra)[0][0]
        return cache[(merge, prefix_tree)]

    return _get
