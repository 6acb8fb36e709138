"""verl plugin (entry point ``verl.plugins: verl_traj_cpu = verl_traj.cpu.plugin:register``).

verl imports this module during ``import verl`` in every process (driver, task runner, workers,
rollout servers). Importing it:

* always registers the CPU rollout backend under the name ``cpu`` in verl's two rollout registries
  (``workers/rollout/base.py:_ROLLOUT_REGISTRY`` and ``workers/rollout/replica.py:RolloutReplicaRegistry``).
  A name in a registry changes nothing unless a config selects it.
* registers the ``cpu`` platform, the FSDP engines for device ``cpu`` (with an unpinned offload policy
  for forward-only engines such as the reference model: pinning needs an accelerator), a gloo-only
  process-group init and a value-model loader that honours the model config's attention implementation
  (verl hard-codes ``flash_attention_2`` for critics; CUDA-only) ONLY when no accelerator is present:
  ``torch.cuda.is_available()`` is false and none of verl's own platforms (nvidia, npu, rocm) detects its hardware with
  its SMI check (the same probe verl's auto-detection uses, so a CPU-only Ray actor on a GPU node is NOT treated as
  CPU-only).

``VERL_TRAJ_CPU=1`` forces the CPU platform, ``VERL_TRAJ_CPU=0`` disables it. An explicit
``VERL_PLATFORM`` other than ``cpu`` also disables it.

* in a CUDA process without flash-attn (and without the CPU platform), registers with transformers the attention
  ``torch_varlen`` (the flash-attention path with the CPU platform's torch kernel, so verl's remove-padding path and the
  prefix tree run there); its first call installs the kernel and verl's engine chunked log-probs
  (:mod:`verl_traj.cpu.torch_flash`: nothing of verl's changes until a model selects it; ``VERL_TRAJ_TORCH_VARLEN=1`` /
  ``0`` forces it on / off).

Every change to a verl module is declared in :mod:`verl_traj.integration.patches.process` (what, why,
when; process-lifetime, never restored) and installed from there; this module supplies the replacements.
Registrations into modules verl has not imported yet are deferred with a post-import hook, so
``import verl`` does not pay for importing the engine and rollout modules.
"""

from __future__ import annotations

import importlib.abc
import logging
import os
import sys
import threading
from datetime import timedelta
from typing import Callable

import torch.distributed

from verl_traj.cpu.attention import CPU_VARLEN, flash_mask, flash_path, varlen_attention
from verl_traj.cpu.detect import cpu_platform_wanted
from verl_traj.cpu.platform import PLATFORM_NAME, PlatformCPU
from verl_traj.integration.patches.process import ON_IMPORT, cpu_platform_patches, cpu_rollout_registrations, install
from verl_traj.cpu import torch_flash

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
# registrations
# ----------------------------------------------------------------------------------------------
def _register_rollout() -> None:
    def add_adapter(registry: dict) -> None:
        registry.setdefault((ROLLOUT_NAME, "async"), _ROLLOUT_ADAPTER_FQN)

    def add_replica(registry: type) -> None:
        def _load():
            # local: a lazy loader: the rollout backend is imported where a config selects it, not on `import verl`
            from verl_traj.cpu.rollout import CPUReplica

            return CPUReplica

        if ROLLOUT_NAME not in registry._registry:
            registry.register(ROLLOUT_NAME, _load)

    install(cpu_rollout_registrations(add_adapter, add_replica), _hook.add)


def _gloo_only(backend):
    """verl builds ``f"cpu:gloo,{device}:{backend}"``, i.e. ``cpu:gloo,cpu:gloo`` on CPU, which torch
    rejects ("Duplicate device type cpu"). On the CPU platform every group is plain gloo."""
    if backend is None:
        return "gloo"
    parts = {p.split(":")[-1] for p in str(backend).split(",") if p}
    return "gloo" if parts <= {"gloo"} else backend


def _gloo_process_group_ray(orig_ray):
    # ``orig_ray`` builds the default string only when backend is None; we always pass one.
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return orig_ray(timeout_second=timeout_second, backend=_gloo_only(backend))

    return initialize_global_process_group_ray


def _gloo_process_group(_verl_init):
    def initialize_global_process_group(timeout_second=36000):
        torch.distributed.init_process_group(
            backend="gloo",
            timeout=timedelta(seconds=timeout_second),
            init_method=os.environ.get("DIST_INIT_METHOD", None),
        )
        return int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    return initialize_global_process_group


def _unpinned_offload_policy(policy_cls):
    """verl builds forward-only engines (the reference model) with ``CPUOffloadPolicy(pin_memory=True)``;
    pinning needs an accelerator, and on the CPU the offload is a no-op anyway: same policy, unpinned."""
    if policy_cls is None:
        return policy_cls

    def offload_policy(*args, **kwargs):
        kwargs["pin_memory"] = False
        return policy_cls(*args, **kwargs)

    return offload_policy


def _register_engines(registry) -> None:
    transformer_impl = sys.modules["verl.workers.engine.fsdp.transformer_impl"]  # imported: it triggers this

    for model_type, cls_name in (("language_model", "FSDPEngineWithLMHead"), ("value_model", "FSDPEngineWithValueHead")):
        engines = registry._engines.setdefault(model_type, {})
        for backend in ("fsdp", "fsdp2"):
            if "cpu" not in engines.get(backend, {}):
                registry.register(model_type=model_type, backend=backend, device="cpu")(getattr(transformer_impl, cls_name))


def cpu_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
    """verl's value-model load (``AutoModelForTokenClassification``, ``num_labels=1`` set by the caller) with
    the config's attention implementation instead of verl's hard-coded ``flash_attention_2``, and no trl."""
    # local: this plugin loads on every `import verl`; transformers' auto classes (~0.4 s) only where a critic loads
    from transformers import AutoModelForTokenClassification

    attn = getattr(model_config, "_attn_implementation", None) or "sdpa"
    if str(attn).startswith("flash_attention"):  # CUDA-only kernels
        attn = "sdpa"
    return AutoModelForTokenClassification.from_pretrained(
        pretrained_model_name_or_path=local_path, torch_dtype=torch_dtype, config=model_config,
        attn_implementation=attn, trust_remote_code=trust_remote_code,
    )


def _copying_save(verl_save):
    """verl's FSDP2 sharded save with every saved tensor a copy (``.cpu()`` of a CPU tensor is the tensor)."""
    def fsdp2_sharded_save_to_cpu(model):
        state, spec = verl_save(model)
        return {name: (tensor.clone(), tensor_spec) for name, (tensor, tensor_spec) in state.items()}, spec

    return fsdp2_sharded_save_to_cpu


def _register_platform() -> None:
    def current_platform(current):
        # verl falls back to 'nvidia' when nothing is detected; make the choice explicit.
        return current if current is not None and current.device_name == "cpu" else PlatformCPU()

    install(cpu_platform_patches(
        register_platform=lambda registry: registry.register(platform=PLATFORM_NAME)(PlatformCPU),
        current_platform=current_platform,
        gloo_process_group_ray=_gloo_process_group_ray,
        gloo_process_group=_gloo_process_group,
        unpinned_offload_policy=_unpinned_offload_policy,
        register_engines=_register_engines,
        # verl's FSDP engine imports it at call time, so the module attribute is enough
        valuehead_loader=lambda _verl_loader: cpu_valuehead_model,
        register_attention=lambda interface: interface.register(CPU_VARLEN, flash_path()),
        register_attention_mask=lambda interface: interface.register(CPU_VARLEN, flash_mask()),
        varlen_attention=lambda _kernel: varlen_attention,
        copying_save=_copying_save,
    ), _hook.add)


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
            elif torch_flash.wanted():  # a CUDA process without flash-attn: torch_varlen
                install(torch_flash.patches(when=ON_IMPORT), _hook.add)
            _state["platform"] = wanted
        return bool(_state["platform"])


# verl's loader only imports the entry point's module (``_ep.load()``); registering happens here.
register()
