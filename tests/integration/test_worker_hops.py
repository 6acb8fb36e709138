"""The worker-side update in a few hops (issue 42, item 5), counted by ``scripts/worker_hops.py`` on a real update:
GSPO at trajectory scope on prefix trees, the case with the most steps (the pre-pass and the tree forward), passes
through at most five adapter modules from ``train_mini_batch`` to the loss, each step of the path one module."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_ADAPTER_MODULES = 5


def test_gspo_on_trees_runs_through_at_most_five_adapter_modules(tiny_home):
    env = dict(os.environ, VERL_TRAJ_HOME=str(tiny_home.parent))
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "worker_hops.py"), "--json", "--cases", "gspo_trees"],
                         env=env, capture_output=True, text=True, timeout=600, check=True).stdout
    start = 0 if out.startswith("[\n") else out.rindex("\n[\n") + 1  # the JSON is printed last, verl's lines before
    (case,) = json.loads(out[start:])
    adapters = [m.removeprefix("verl_traj.integration.") for m in case["adapter_modules"]]
    assert len(adapters) <= MAX_ADAPTER_MODULES, adapters
    # the path's steps: the worker (with GSPO's pre-pass), the plan, the catalogue's patched, the tree, the loss
    assert set(adapters) == {"workers.engine_workers", "workers.planned_update", "patches.scoped", "tree.tree_forward",
                             "workers.losses"}, adapters
    assert "verl_traj.stepwise.ratios" in case["core_modules"]  # the pre-pass ran (its arithmetic)
    assert "verl_traj.core.kernels.tree_kernel" in case["core_modules"]  # the tree attention ran
    assert case["stack_at_loss"][0] == "verl_traj.integration.workers.engine_workers"
    assert case["first_update_only"] == ["verl_traj.integration.patches.process"]  # the one-time install, set-up
