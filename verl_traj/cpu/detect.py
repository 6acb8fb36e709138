"""Whether a process runs verl_traj's CPU platform: :func:`accelerator_present` (the probe verl's own auto-detection
uses) and :func:`cpu_platform_wanted` (that, under ``VERL_TRAJ_CPU`` / ``VERL_PLATFORM``). Read by the plugin
(:mod:`verl_traj.cpu.plugin`) and the rollout server (where its model runs); imports nothing of verl_traj."""

from __future__ import annotations

import os

import torch

from verl.plugin.platform.platform_manager import PlatformRegistry

__all__ = ["accelerator_present", "cpu_platform_wanted"]


def accelerator_present() -> bool:
    """True when any accelerator verl knows about is visible to this host."""
    try:
        if torch.cuda.is_available():
            return True
        for attr in ("xpu", "npu", "mlu", "musa"):
            mod = getattr(torch, attr, None)
            if mod is not None and getattr(mod, "is_available", lambda: False)():
                return True
    except Exception:  # pragma: no cover
        return True  # be conservative: never turn a broken GPU setup into a CPU run
    try:
        for name in PlatformRegistry.registered_names():
            if name == "cpu":
                continue
            cls = PlatformRegistry.get(name)
            try:
                if cls is not None and cls().is_platform_available(use_smi_check=True):
                    return True
            except Exception:
                continue
    except Exception:  # pragma: no cover
        pass
    return False


def cpu_platform_wanted() -> bool:
    """``VERL_TRAJ_CPU=1`` / ``0`` forces it on / off, a ``VERL_PLATFORM`` other than ``cpu`` off; else where no
    accelerator is present."""
    forced = os.environ.get("VERL_TRAJ_CPU", "").strip().lower()
    if forced in ("0", "false", "no", "off"):
        return False
    env_platform = os.environ.get("VERL_PLATFORM", "").strip().lower()
    if env_platform and env_platform != "cpu":
        return False
    if forced in ("1", "true", "yes", "on") or env_platform == "cpu":
        return True
    return not accelerator_present()
