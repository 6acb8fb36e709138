"""What verl_traj changes inside verl for the whole life of a process, in one place, with the order written out.

:mod:`verl_traj.integration.patches.scoped` lists the scoped patches: installed for one call, restored on exit. The
changes here are the other kind: the CPU platform plugin (:mod:`verl_traj.cpu.plugin`, loaded by verl in
every process) makes them once and never restores them (``restored=False`` on every entry). Each entry says
which verl module attribute changes, how (``kind``), when (``when``) and why. The plugin passes the
replacements in; this module imports nothing of verl_traj (it lists patches, it does not use the plugin).

* :func:`cpu_rollout_registrations` -- every process (a name in a registry changes nothing unless a config
  selects it), after verl imports the registry's module:
  1. ``verl.workers.rollout.base._ROLLOUT_REGISTRY`` += the ``cpu`` server adapter (by its import path);
  2. ``verl.workers.rollout.replica.RolloutReplicaRegistry`` += the ``cpu`` replica (loaded on first use).
* :func:`cpu_platform_patches` -- only in processes without an accelerator (the plugin decides), in order:
  1. ``verl.plugin.platform.platform_manager.PlatformRegistry`` += the ``cpu`` platform;
  2. ``platform_manager._current_platform`` <- the CPU platform (unless it already is one);
  3. ``verl.utils.distributed.initialize_global_process_group_ray`` <- the same with a gloo-only backend;
  4. ``verl.utils.distributed.initialize_global_process_group`` <- a gloo process group;
  5. both names in ``verl.workers.engine_workers``, ``verl.checkpoint_engine.base`` and
     ``verl.trainer.sft_trainer``, where already imported, <- the replacements of 3 and 4 (those modules
     bound verl's functions by name before the plugin ran);
  6. ``verl.workers.engine.fsdp.transformer_impl.CPUOffloadPolicy`` <- the same policy, unpinned (after import);
  7. ``verl.workers.engine.base.EngineRegistry`` += the FSDP engines for device ``cpu`` (after
     ``transformer_impl`` is imported: it defines them);
  8. ``verl.utils.model.load_valuehead_model`` <- a loader honouring the config's attention (after import);
  9. ``transformers.modeling_utils.AttentionInterface`` and ``transformers.masking_utils.AttentionMaskInterface``
     += ``cpu_varlen`` (transformers' flash-attention path and mask under that name), after each is imported;
  10. ``transformers.integrations.flash_attention._flash_attention_forward`` and
     ``verl.models.transformers.monkey_patch._flash_attention_forward`` (what verl's Ulysses wrapper calls) <- the
     pure-torch variable-length attention (:mod:`verl_traj.cpu.attention`), after each module is imported.
  11. ``verl.utils.fsdp_utils.fsdp2_sharded_save_to_cpu`` (what ``separate_async``'s ``DetachActorWorker`` saves
     the policy of a sync cycle with) <- the same returning copies, after import: on a CPU device ``.cpu()`` is the
     tensor itself, so the saved state would follow every optimizer step and the old log-probs of a cycle's later
     local updates would come from the current weights.

* :func:`prefix_tree_attention_patches` -- only in a process that enables the prefix-tree forward
  (:mod:`verl_traj.integration.tree.tree_forward`, opt-in), installed there once, now (idempotent):
  ``verl.models.transformers.monkey_patch._flash_attention_forward`` (the kernel verl's remove-padding / Ulysses
  path calls; entry 10 on CPU) <- a tree-aware wrapper of it: a call carrying a prefix tree runs the exact tree
  attention, any other runs the wrapped kernel after refusing tree-shaped position ids.
* :func:`torch_varlen_patches` -- in a CUDA process without flash-attn (:mod:`verl_traj.cpu.torch_flash`): its
  registrations (entry 9 under the name ``torch_varlen``) in every such process through the plugin, after each module
  is imported; entry 10 (verl's module only; where the tree-aware wrapper already is, that wrapper of the torch kernel)
  when the ``torch_varlen`` attention is first called, now; ``scripts/bench_update.py --device cuda`` all of it, now:
  so verl's remove-padding path and the prefix-tree forward run there, and a process whose model does not select it
  keeps verl's functions.
* :func:`fused_logprobs_patches` -- with entry 10: ``verl.workers.engine.fsdp.transformer_impl.logprobs_from_logits``
  <- the chunked fp32 log-softmax (flash-attn's fused cross-entropy's numbers, scratch bounded; verl's fallback loops
  over tokens).
* :func:`tool_parser_log_patches` -- in an agent-loop worker process, when the first
  :class:`~verl_traj.integration.agent_loops.stepwise_agent_loop.StepwiseToolAgentLoop` is built, and in the calculator
  recipe's offline evaluation (both through ``counting_tool_parser``), now (idempotent):
  ``verl.experimental.agent_loop.tool_parser.logger`` += a filter that counts, inside a training session, each tool
  call the model wrote malformed (``traj_agent/malformed_tool_call_share``) instead of logging it at ERROR; outside a
  session the record passes.

:func:`install` installs a list in order; ``on_import(module_name, callback)`` is the caller's post-import
hook for the entries that wait for verl to import their module.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

__all__ = ["ProcessPatch", "UPSTREAM", "REPLACE", "REGISTER", "NOW", "IF_LOADED", "ON_IMPORT", "apply", "install",
           "cpu_rollout_registrations", "cpu_platform_patches", "fused_logprobs_patches", "prefix_tree_attention_patches",
           "tool_parser_log_patches", "torch_varlen_patches",
           "PROCESS_GROUP_MODULES", "PROCESS_GROUP_FUNCTIONS"]

REPLACE = "replace"  # module.name = change(module.name); no write when change returns the original
REGISTER = "register"  # change(module.name) adds entries to verl's registry object in place; the name is kept
NOW = "now"  # import the module and change it now
IF_LOADED = "if_loaded"  # change it now if the process has imported the module already, else never
ON_IMPORT = "on_import"  # change it right after verl imports ``after`` (or the module itself); now if it has

DISTRIBUTED = "verl.utils.distributed"
PLATFORM_MANAGER = "verl.plugin.platform.platform_manager"
FSDP_ENGINE = "verl.workers.engine.fsdp.transformer_impl"
PROCESS_GROUP_FUNCTIONS = ("initialize_global_process_group_ray", "initialize_global_process_group")
TRANSFORMERS_FLASH = "transformers.integrations.flash_attention"
VERL_MONKEY_PATCH = "verl.models.transformers.monkey_patch"
# modules that import verl.utils.distributed's process-group functions by name
PROCESS_GROUP_MODULES = ("verl.workers.engine_workers", "verl.checkpoint_engine.base", "verl.trainer.sft_trainer")


ITSELF = "none needed: this is {}'s extension point (an entry added, nothing replaced)"
# For every change here: the extension point that would make it unnecessary (none of the replacements' exists in verl
# 0.9.1 / transformers 5), or, for a registration, the registry it uses.
UPSTREAM = {
    ("verl.workers.rollout.base", "_ROLLOUT_REGISTRY"): ITSELF.format("verl"),
    ("verl.workers.rollout.replica", "RolloutReplicaRegistry"): ITSELF.format("verl"),
    (PLATFORM_MANAGER, "PlatformRegistry"): ITSELF.format("verl"),
    (PLATFORM_MANAGER, "_current_platform"): "verl's platform detection choosing a registered platform on a machine "
                                             "without an accelerator (it falls back to 'nvidia')",
    **{(module, name): "a process-group backend setting (verl passes 'cpu:gloo,cpu:gloo', which torch rejects)"
       for module in (DISTRIBUTED, *PROCESS_GROUP_MODULES) for name in PROCESS_GROUP_FUNCTIONS},
    (FSDP_ENGINE, "CPUOffloadPolicy"): "a pin-memory setting of verl's forward-only engines",
    ("verl.workers.engine.base", "EngineRegistry"): ITSELF.format("verl"),
    ("verl.utils.model", "load_valuehead_model"): "the value model loaded with the config's attn_implementation "
                                                  "(verl hard-codes flash_attention_2)",
    ("transformers.modeling_utils", "AttentionInterface"): ITSELF.format("transformers"),
    ("transformers.masking_utils", "AttentionMaskInterface"): ITSELF.format("transformers"),
    (TRANSFORMERS_FLASH, "_flash_attention_forward"): "a registered attention that verl's remove-padding path accepts "
                                                      "(it calls transformers' flash path by name)",
    (VERL_MONKEY_PATCH, "_flash_attention_forward"): "an attention hook that carries a prefix tree (or a torch kernel) "
                                                     "through verl's remove-padding and Ulysses wrapper",
    ("verl.utils.fsdp_utils", "fsdp2_sharded_save_to_cpu"): "a copy in verl's save where the device is the CPU (an "
                                                            "upstream fix)",
    (FSDP_ENGINE, "logprobs_from_logits"): "a vectorised fallback in verl where flash-attn's fused cross-entropy is "
                                           "missing (an upstream fix)",
    ("verl.experimental.agent_loop.tool_parser", "logger"): ITSELF.format("Python logging") + " (a filter)",
}


@dataclass(frozen=True)
class ProcessPatch:
    """``module.name`` changed for the process lifetime by ``change`` (see ``kind``), at ``when``."""

    module: str
    name: str
    change: Callable[[Any], Any]
    why: str
    kind: str = REPLACE
    when: str = NOW
    after: Optional[str] = None  # ON_IMPORT: the module whose import triggers the change (default: ``module``)
    restored: bool = False  # process-lifetime: nothing here is ever restored


def apply(patch: ProcessPatch, module: Any) -> None:
    """Make one change on the imported ``module``; a name this verl version lacks is skipped, except for NOW."""
    if not hasattr(module, patch.name):
        if patch.when == NOW:
            raise AttributeError(f"{patch.module}.{patch.name} does not exist in this verl version; cannot {patch.why}")
        return
    current = getattr(module, patch.name)
    if patch.kind == REGISTER:
        patch.change(current)
        return
    replacement = patch.change(current)
    if replacement is not current:
        setattr(module, patch.name, replacement)


def install(patches: Sequence[ProcessPatch], on_import: Callable[[str, Callable[[Any], None]], None]) -> None:
    """Install ``patches`` in order (ON_IMPORT ones through ``on_import``, when their module is imported)."""
    for p in patches:
        if p.when == ON_IMPORT:
            on_import(p.after or p.module, lambda loaded, p=p: apply(p, importlib.import_module(p.module)
                                                                       if p.after else loaded))
        elif p.when == IF_LOADED:
            if p.module in sys.modules:
                apply(p, sys.modules[p.module])
        else:
            apply(p, importlib.import_module(p.module))


def cpu_rollout_registrations(register_adapter: Callable[[dict], None],
                              register_replica: Callable[[type], None]) -> list[ProcessPatch]:
    """The ``cpu`` rollout backend in verl's two rollout registries (every process)."""
    return [
        ProcessPatch("verl.workers.rollout.base", "_ROLLOUT_REGISTRY", register_adapter,
                     "name the CPU rollout server adapter 'cpu'", kind=REGISTER, when=ON_IMPORT),
        ProcessPatch("verl.workers.rollout.replica", "RolloutReplicaRegistry", register_replica,
                     "name the CPU rollout replica 'cpu'", kind=REGISTER, when=ON_IMPORT),
    ]


def cpu_platform_patches(*, register_platform: Callable[[type], None], current_platform: Callable[[Any], Any],
                         gloo_process_group_ray: Callable[[Callable], Callable],
                         gloo_process_group: Callable[[Callable], Callable],
                         unpinned_offload_policy: Callable[[Any], Any], register_engines: Callable[[type], None],
                         valuehead_loader: Callable[[Callable], Callable],
                         register_attention: Callable[[type], None], register_attention_mask: Callable[[type], None],
                         varlen_attention: Callable[[Callable], Callable],
                         copying_save: Callable[[Callable], Callable]) -> list[ProcessPatch]:
    """The CPU platform (processes without an accelerator); order: module docstring."""
    out = [
        ProcessPatch(PLATFORM_MANAGER, "PlatformRegistry", register_platform, "name the CPU platform 'cpu'",
                     kind=REGISTER),
        ProcessPatch(PLATFORM_MANAGER, "_current_platform", current_platform,
                     "make the CPU platform verl's current one (verl falls back to 'nvidia' when it detects nothing)"),
        ProcessPatch(DISTRIBUTED, "initialize_global_process_group_ray", gloo_process_group_ray,
                     "init gloo-only process groups (verl's 'cpu:gloo,cpu:gloo' is rejected by torch)"),
        ProcessPatch(DISTRIBUTED, "initialize_global_process_group", gloo_process_group,
                     "init a gloo process group"),
    ]
    out += [ProcessPatch(module, name, lambda _bound, name=name: getattr(sys.modules[DISTRIBUTED], name),
                         "use the gloo process-group init where verl imported the function by name", when=IF_LOADED)
            for module in PROCESS_GROUP_MODULES for name in PROCESS_GROUP_FUNCTIONS]
    out += [
        ProcessPatch(FSDP_ENGINE, "CPUOffloadPolicy", unpinned_offload_policy,
                     "build forward-only engines without pinned memory (pinning needs an accelerator)", when=ON_IMPORT),
        ProcessPatch("verl.workers.engine.base", "EngineRegistry", register_engines,
                     "register the FSDP engines for device 'cpu'", kind=REGISTER, when=ON_IMPORT, after=FSDP_ENGINE),
        ProcessPatch("verl.utils.model", "load_valuehead_model", valuehead_loader,
                     "load value models with the config's attention (verl hard-codes CUDA-only flash_attention_2)",
                     when=ON_IMPORT),
        ProcessPatch("transformers.modeling_utils", "AttentionInterface", register_attention,
                     "name transformers' flash-attention path 'cpu_varlen' (the path verl's Ulysses patch wraps)",
                     kind=REGISTER, when=ON_IMPORT),
        ProcessPatch("transformers.masking_utils", "AttentionMaskInterface", register_attention_mask,
                     "give 'cpu_varlen' the flash-attention mask (None or the 2-D padding mask)", kind=REGISTER,
                     when=ON_IMPORT),
        ProcessPatch(TRANSFORMERS_FLASH, "_flash_attention_forward", varlen_attention,
                     "run flash-attention's variable-length contract in torch (the CUDA kernel's place)",
                     when=ON_IMPORT),
        ProcessPatch(VERL_MONKEY_PATCH, "_flash_attention_forward", varlen_attention,
                     "the kernel verl's Ulysses all-to-all wrapper calls, in torch", when=ON_IMPORT),
        ProcessPatch("verl.utils.fsdp_utils", "fsdp2_sharded_save_to_cpu", copying_save,
                     "save a copy of the policy (on CPU '.cpu()' aliases the live parameters, which the optimizer "
                     "then changes in place)", when=ON_IMPORT),
    ]
    return out


def prefix_tree_attention_patches(tree_aware_attention: Callable[[Callable], Callable]) -> list[ProcessPatch]:
    """The prefix-tree forward's attention (a process that enables it; order: module docstring).
    ``tree_aware_attention(kernel)`` returns ``kernel`` itself when it is already tree-aware (no second wrap)."""
    return [ProcessPatch(VERL_MONKEY_PATCH, "_flash_attention_forward", tree_aware_attention,
                         "run prefix-tree micro-batches through the exact tree attention and refuse tree-shaped "
                         "position ids in any other attention call")]


def torch_varlen_patches(name: str, register_attention: Callable[[Any], None],
                         register_attention_mask: Callable[[Any], None],
                         kernel: Callable[[Callable], Callable], when: str = NOW) -> list[ProcessPatch]:
    """transformers' flash-attention path and mask under ``name`` and verl's ``_flash_attention_forward`` <- the
    torch variable-length kernel, for a GPU process without flash-attn (order: module docstring)."""
    return [ProcessPatch("transformers.modeling_utils", "AttentionInterface", register_attention,
                         f"name transformers' flash-attention path '{name}'", kind=REGISTER, when=when),
            ProcessPatch("transformers.masking_utils", "AttentionMaskInterface", register_attention_mask,
                         f"give '{name}' the flash-attention mask", kind=REGISTER, when=when),
            ProcessPatch(VERL_MONKEY_PATCH, "_flash_attention_forward", kernel,
                         "run flash-attention's variable-length contract in torch where flash-attn is missing",
                         when=when)]


def fused_logprobs_patches(logprobs_from_logits: Callable[[Callable], Callable],
                           when: str = NOW) -> list[ProcessPatch]:
    """A CUDA process without flash-attn (order: module docstring): verl's engine log-probs <- the chunked fp32
    log-softmax (verl's fallback is a Python loop over the tokens, which would set the time)."""
    return [ProcessPatch(FSDP_ENGINE, "logprobs_from_logits", logprobs_from_logits,
                         "the chunked fp32 log-softmax where flash-attn's fused cross-entropy is missing",
                         when=when)]


def tool_parser_log_patches(add_counter: Callable[[Any], None]) -> list[ProcessPatch]:
    """The malformed-tool-call counter on verl's tool-parser logger (order: module docstring). ``add_counter(logger)``
    adds the filter unless the logger has it (installing twice changes nothing)."""
    return [ProcessPatch("verl.experimental.agent_loop.tool_parser", "logger", add_counter,
                         "count the tool calls a policy writes malformed as a metric instead of an ERROR line each",
                         kind=REGISTER)]
