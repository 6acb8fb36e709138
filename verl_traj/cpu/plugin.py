"""verl plugin (entry point ``verl.plugins: verl_traj_cpu = verl_traj.cpu.plugin:register``).

verl imports this module during ``import verl`` in every process (driver, task runner, workers,
rollout servers). Importing it:

* always registers the CPU rollout backend under the name ``cpu`` in verl's two rollout registries
  (``workers/rollout/base.py:_ROLLOUT_REGISTRY`` and ``workers/rollout/replica.py:RolloutReplicaRegistry``).
  A name in a registry changes nothing unless a config selects it.
* registers the ``cpu`` platform, the FSDP engines for device ``cpu`` (with an unpinned offload policy
  for forward-only engines such as the reference model: pinning needs an accelerator), a gloo-only
  process-group init and a value-model loader that honours the model config's attention implementation
  (verl hard-codes ``flash_attention_2`` for critics; CUDA-only) ONLY when no accelerator is present: ``torch.cuda.is_available()`` is false and none of
  verl's own platforms (nvidia, npu, rocm) detects its hardware with its SMI check (the same probe
  verl's auto-detection uses, so a CPU-only Ray actor on a GPU node is NOT treated as CPU-only).

``VERL_TRAJ_CPU=1`` forces the CPU platform, ``VERL_TRAJ_CPU=0`` disables it. An explicit
``VERL_PLATFORM`` other than ``cpu`` also disables it.

Registrations into modules verl has not imported yet are deferred with a post-import hook, so
``import verl`` does not pay for importing the engine and rollout modules.
"""

from __future__ import annotations

import importlib.abc
import logging
import os
import sys
import threading
from typing import Callable

logger = logging.getLogger(__name__)

ROLLOUT_NAME = "cpu"
_ROLLOUT_ADAPTER_FQN = "verl_traj.cpu.rollout.CPUServerAdapter"

_lock = threading.Lock()
_state = {"rollout": False, "platform": None}


# ----------------------------------------------------------------------------------------------
# post-import hook
# ----------------------------------------------------------------------------------------------
class _PostImportHook(importlib.abc.MetaPathFinder):
    """Runs callbacks right after a named module has executed (once)."""

    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callable]] = {}

    def add(self, module_name: str, callback: Callable) -> None:
        module = sys.modules.get(module_name)
        if module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False) is False:
            callback(module)
            return
        self.callbacks.setdefault(module_name, []).append(callback)

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.callbacks:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        callbacks = self.callbacks.pop(fullname)
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module):
            original_exec(module)
            for cb in callbacks:
                try:
                    cb(module)
                except Exception:  # pragma: no cover - never break verl's import
                    logger.exception("verl_traj.cpu: post-import registration for %s failed", fullname)

        loader.exec_module = exec_module  # loaders are per-module instances
        return spec


_hook = _PostImportHook()
sys.meta_path.insert(0, _hook)


# ----------------------------------------------------------------------------------------------
# accelerator detection
# ----------------------------------------------------------------------------------------------
def accelerator_present() -> bool:
    """True when any accelerator verl knows about is visible to this host."""
    try:
        import torch

        if torch.cuda.is_available():
            return True
        for attr in ("xpu", "npu", "mlu", "musa"):
            mod = getattr(torch, attr, None)
            if mod is not None and getattr(mod, "is_available", lambda: False)():
                return True
    except Exception:  # pragma: no cover
        return True  # be conservative: never turn a broken GPU setup into a CPU run
    try:
        from verl.plugin.platform.platform_manager import PlatformRegistry

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
    forced = os.environ.get("VERL_TRAJ_CPU", "").strip().lower()
    if forced in ("0", "false", "no", "off"):
        return False
    env_platform = os.environ.get("VERL_PLATFORM", "").strip().lower()
    if env_platform and env_platform != "cpu":
        return False
    if forced in ("1", "true", "yes", "on") or env_platform == "cpu":
        return True
    return not accelerator_present()


# ----------------------------------------------------------------------------------------------
# registrations
# ----------------------------------------------------------------------------------------------
def _register_rollout() -> None:
    def add_adapter(module):
        module._ROLLOUT_REGISTRY.setdefault((ROLLOUT_NAME, "async"), _ROLLOUT_ADAPTER_FQN)

    def add_replica(module):
        def _load():
            from verl_traj.cpu.rollout import CPUReplica

            return CPUReplica

        if ROLLOUT_NAME not in module.RolloutReplicaRegistry._registry:
            module.RolloutReplicaRegistry.register(ROLLOUT_NAME, _load)

    _hook.add("verl.workers.rollout.base", add_adapter)
    _hook.add("verl.workers.rollout.replica", add_replica)


def _gloo_only(backend):
    """verl builds ``f"cpu:gloo,{device}:{backend}"``, i.e. ``cpu:gloo,cpu:gloo`` on CPU, which torch
    rejects ("Duplicate device type cpu"). On the CPU platform every group is plain gloo."""
    if backend is None:
        return "gloo"
    parts = {p.split(":")[-1] for p in str(backend).split(",") if p}
    return "gloo" if parts <= {"gloo"} else backend


def _patch_process_group_init() -> None:
    """Scoped to the CPU platform: only called when it is registered."""
    import verl.utils.distributed as dist_mod

    if _state.get("process_group"):
        return
    orig_ray = dist_mod.initialize_global_process_group_ray
    orig_global = dist_mod.initialize_global_process_group

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return orig_ray(timeout_second=timeout_second, backend=_gloo_only(backend))

    def initialize_global_process_group(timeout_second=36000):
        import torch.distributed

        from datetime import timedelta

        torch.distributed.init_process_group(
            backend="gloo",
            timeout=timedelta(seconds=timeout_second),
            init_method=os.environ.get("DIST_INIT_METHOD", None),
        )
        return int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    # ``orig_ray`` builds the default string only when backend is None; we always pass one.
    dist_mod.initialize_global_process_group_ray = initialize_global_process_group_ray
    dist_mod.initialize_global_process_group = initialize_global_process_group
    _state["process_group"] = True
    # modules that imported the names before us
    for name in ("verl.workers.engine_workers", "verl.checkpoint_engine.base", "verl.trainer.sft_trainer"):
        mod = sys.modules.get(name)
        if mod is None:
            continue
        if hasattr(mod, "initialize_global_process_group_ray"):
            mod.initialize_global_process_group_ray = initialize_global_process_group_ray
        if hasattr(mod, "initialize_global_process_group"):
            mod.initialize_global_process_group = initialize_global_process_group


def _unpinned_offload_policy(policy_cls):
    """verl builds forward-only engines (the reference model) with ``CPUOffloadPolicy(pin_memory=True)``;
    pinning needs an accelerator, and on the CPU the offload is a no-op anyway: same policy, unpinned."""

    def offload_policy(*args, **kwargs):
        kwargs["pin_memory"] = False
        return policy_cls(*args, **kwargs)

    return offload_policy


def _register_engines() -> None:
    def add_engines(module):
        from verl.workers.engine.base import EngineRegistry

        if getattr(module, "CPUOffloadPolicy", None) is not None:
            module.CPUOffloadPolicy = _unpinned_offload_policy(module.CPUOffloadPolicy)

        for model_type, cls_name in (("language_model", "FSDPEngineWithLMHead"), ("value_model", "FSDPEngineWithValueHead")):
            registry = EngineRegistry._engines.setdefault(model_type, {})
            for backend in ("fsdp", "fsdp2"):
                if "cpu" not in registry.get(backend, {}):
                    EngineRegistry.register(model_type=model_type, backend=backend, device="cpu")(getattr(module, cls_name))

    _hook.add("verl.workers.engine.fsdp.transformer_impl", add_engines)


def cpu_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
    """verl's value-model load (``AutoModelForTokenClassification``, ``num_labels=1`` set by the caller) with
    the config's attention implementation instead of verl's hard-coded ``flash_attention_2``, and no trl."""
    from transformers import AutoModelForTokenClassification

    attn = getattr(model_config, "_attn_implementation", None) or "sdpa"
    if str(attn).startswith("flash_attention"):  # CUDA-only kernels
        attn = "sdpa"
    return AutoModelForTokenClassification.from_pretrained(
        pretrained_model_name_or_path=local_path, torch_dtype=torch_dtype, config=model_config,
        attn_implementation=attn, trust_remote_code=trust_remote_code,
    )


def _register_valuehead_loader() -> None:
    def replace(module):  # verl's FSDP engine imports it at call time, so the module attribute is enough
        module.load_valuehead_model = cpu_valuehead_model

    _hook.add("verl.utils.model", replace)


def _register_platform() -> None:
    from verl.plugin.platform import platform_manager

    from verl_traj.cpu.platform import PLATFORM_NAME, PlatformCPU

    platform_manager.PlatformRegistry.register(platform=PLATFORM_NAME)(PlatformCPU)
    current = platform_manager._current_platform
    if current is None or current.device_name != "cpu":
        # verl falls back to 'nvidia' when nothing is detected; make the choice explicit.
        platform_manager._current_platform = PlatformCPU()
    _patch_process_group_init()
    _register_engines()
    _register_valuehead_loader()


def register() -> bool:
    """Idempotent. Returns True when the CPU platform is active in this process."""
    with _lock:
        if not _state["rollout"]:
            _register_rollout()
            _state["rollout"] = True
        if _state["platform"] is None:
            wanted = cpu_platform_wanted()
            if wanted:
                _register_platform()
            _state["platform"] = wanted
        return bool(_state["platform"])


def cpu_platform_active() -> bool:
    return bool(_state["platform"])


# verl's loader only imports the entry point's module (``_ep.load()``); registering happens here.
register()
