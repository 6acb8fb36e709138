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


def test_a_cpu_preset_on_a_process_with_a_gpu_platform_is_refused_before_verl_rewrites_the_device(monkeypatch):
    """Regression: the platform check ran after verl's auto_set_device, which silently turns trainer.device=cpu into
    the detected accelerator, so a CPU preset on a GPU machine became a CUDA job unnoticed. The process's platform is
    made to look like an accelerator's here; run() must refuse before Ray starts, naming the switch."""
    from types import SimpleNamespace

    import pytest
    import verl.trainer.main_ppo as verl_main
    import verl.utils.device as device

    from verl_traj import main_ppo
    from verl_traj.config import TrajConfigError
    from verl_traj.testing.engine import cpu_config

    gpu = SimpleNamespace(device_name="cuda")
    monkeypatch.setattr(device, "get_platform", lambda: gpu)
    monkeypatch.setattr(device, "get_device_name", lambda: "cuda")
    monkeypatch.setattr(verl_main, "run_ppo", lambda *a, **k: pytest.fail("training started"))
    cfg = cpu_config(["traj.enable=false"])  # a CPU preset: trainer.device=cpu
    with pytest.raises(TrajConfigError, match="trainer.device='cpu'.*VERL_TRAJ_CPU=1") as err:
        main_ppo.run(cfg)
    assert err.value.field == "trainer.device" and cfg.trainer.device == "cpu"


def test_transfer_queue_asks_for_no_more_threads_than_the_machine_has(monkeypatch):
    import psutil

    from verl_traj import main_ppo

    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 2)
    environ: dict = {}
    main_ppo.transfer_queue_threads(environ)
    assert environ == {"TQ_NUM_THREADS": "2"}
    environ = {"TQ_NUM_THREADS": "1"}  # the user's own setting wins
    main_ppo.transfer_queue_threads(environ)
    assert environ == {"TQ_NUM_THREADS": "1"}
