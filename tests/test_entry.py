"""``python -m verl_traj.main_ppo``'s process environment."""

import os
import subprocess
import sys

from verl_traj.main_ppo import OPTIONAL_ENGINE_WARNINGS, quiet_optional_engine_warnings


def test_optional_engine_warnings_are_filtered_in_child_processes_and_user_filters_kept():
    """verl warns once per optional engine it cannot import, in every Ray worker; the filter travels through
    PYTHONWARNINGS (inherited by Ray's workers), and a user's own filters stay first."""
    env = {"PYTHONWARNINGS": "error::ResourceWarning"}
    quiet_optional_engine_warnings(env)
    quiet_optional_engine_warnings(env)  # idempotent
    assert env["PYTHONWARNINGS"].split(",") == ["error::ResourceWarning", *OPTIONAL_ENGINE_WARNINGS]
    code = "import warnings; import verl.workers.engine"

    noisy = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"})
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "PYTHONWARNINGS": env["PYTHONWARNINGS"]})
    assert noisy.returncode == quiet.returncode == 0, quiet.stderr[-2000:]
    assert "engine is not available" not in quiet.stderr
    assert "engine is not available" in noisy.stderr  # the filter is what silences them (verl still warns)
