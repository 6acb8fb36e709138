"""verl platform for machines without an accelerator ("cpu").

Registered by :mod:`verl_traj.cpu.plugin` (verl's ``verl.plugins`` entry point) only when no
accelerator is present. verl's code talks to the device through ``get_platform()`` and
``get_torch_device()``; this platform answers with the CPU: gloo collectives, ``torch.device("cpu")``
as the current device, and a ``torch.cpu``-like device module whose CUDA-only calls
(``empty_cache``, ``mem_get_info``, ``memory_allocated``, RNG state, ...) have CPU meanings.
"""

from __future__ import annotations

import contextlib
import os
import resource
import types
from typing import Any, Optional

import torch

from verl.plugin.platform.platform_base import PlatformBase

PLATFORM_NAME = "cpu"


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # pragma: no cover - non-Linux
        return 0


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _mem_get_info(device: Any = None) -> tuple[int, int]:
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    free = total
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    break
    except OSError:  # pragma: no cover
        pass
    return free, total


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _make_device_module() -> types.ModuleType:
    """A ``torch.cpu`` look-alike that also answers the ``torch.cuda`` calls verl makes."""
    mod = types.ModuleType("verl_traj_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("_"):
            setattr(mod, name, getattr(torch.cpu, name))
    mod.is_available = lambda: True
    mod.device_count = lambda: 1
    mod.current_device = lambda: torch.device("cpu")
    mod.set_device = _noop
    mod.synchronize = _noop
    mod.empty_cache = _noop
    mod.ipc_collect = _noop
    mod.reset_peak_memory_stats = _noop
    mod.set_per_process_memory_fraction = _noop
    mod.mem_get_info = _mem_get_info
    mod.memory_allocated = lambda device=None: _rss_bytes()
    mod.memory_reserved = lambda device=None: _rss_bytes()
    mod.max_memory_allocated = lambda device=None: _peak_rss_bytes()
    mod.max_memory_reserved = lambda device=None: _peak_rss_bytes()
    mod.get_device_name = lambda device=None: "cpu"
    mod.get_rng_state = lambda device=None: torch.get_rng_state()
    mod.set_rng_state = lambda state, device=None: torch.set_rng_state(state)
    mod.manual_seed = torch.manual_seed
    mod.manual_seed_all = torch.manual_seed
    mod.is_initialized = lambda: True
    return mod


_DEVICE_MODULE = _make_device_module()


class PlatformCPU(PlatformBase):
    """CPU-only platform: gloo, fp32, one logical "device" per process."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return _DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Registered only when no accelerator was found (see plugin.py).
        return True

    def current_device(self) -> torch.device:  # verl uses it for ``module.to(get_device_id())``
        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        # Ray sets CUDA_VISIBLE_DEVICES for actors holding logical GPUs; harmless on CPU.
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        # verl's placement groups ask for one accelerator per worker; on CPU these are the logical
        # GPUs given to Ray with ``ray_kwargs.ray_init.num_gpus`` (see configs/cpu_tiny.yaml).
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
