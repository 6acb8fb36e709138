"""The multi-node launcher opens nothing to the network by default: Ray's dashboard (and its unauthenticated
job-submission API) binds to 127.0.0.1 unless the user opts in, and then the script warns loudly."""

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "calc_agent" / "run_multinode.sh"


def _dry_run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], env={**os.environ, "DRY_RUN": "1", **env},
                          capture_output=True, text=True, check=True)


def test_head_binds_the_dashboard_to_loopback_by_default():
    env = {k: v for k, v in os.environ.items() if k != "RAY_DASHBOARD_HOST"}
    run = subprocess.run(["bash", str(SCRIPT), "head"], env={**env, "DRY_RUN": "1"}, capture_output=True, text=True,
                         check=True)
    assert "--dashboard-host=127.0.0.1" in run.stdout and "0.0.0.0" not in run.stdout
    assert run.stderr == ""


def test_opting_into_another_address_warns():
    run = _dry_run("head", RAY_DASHBOARD_HOST="0.0.0.0")
    assert "--dashboard-host=0.0.0.0" in run.stdout
    assert "WARNING" in run.stderr and "arbitrary code execution" in run.stderr


def test_submit_targets_the_local_dashboard_and_ships_relative_recipe_paths():
    run = _dry_run("submit")
    assert "--address=http://127.0.0.1:8265" in run.stdout
    assert "function_tool_path=verl_traj/recipes/calc_agent/tool.py" in run.stdout
