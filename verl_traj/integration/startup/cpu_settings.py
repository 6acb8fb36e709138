"""What the CPU platform settles at start-up: the attention implementation verl's code paths need there, and what
the CPU rollout cannot do.

* Attention (actor and reference, which share ``actor_rollout_ref.model``, and the critic's ``critic.model``). verl's
  Ulysses sequence parallelism wraps only the flash-attention path (an all-to-all around its varlen call); under
  ``sdpa`` or ``eager`` each rank attends to its own slice of the sequence, which trains but computes something else
  (log-prob error ~4e-4, gradient norm ~1% off). The CPU presets leave ``override_config.attn_implementation`` null,
  and start-up picks: :data:`~verl_traj.integration.config.attention_names.CPU_VARLEN` (the flash-attention path with flash-attention's
  varlen contract in torch) where the section's Ulysses size is > 1, else ``sdpa`` (exact on CPU with and without
  remove-padding: transformers masks packed sequences by their position ids). A value the user set is kept where it
  is right and refused where it is not: anything but ``cpu_varlen`` under Ulysses, and the CUDA-only
  ``flash_attention_*`` kernels (the actor fails to load them; verl_traj's value-head loader would quietly fall back
  to ``sdpa``).
* LoRA on the CPU rollout (``actor_rollout_ref.rollout.name=cpu``): the rollout loads full weights only, so without
  ``actor_rollout_ref.model.lora.merge=true`` the first weight sync (after the first update) fails.

* verl's ``separate_async`` mode (:func:`settle_cpu_separate_async`): a standalone rollout pool (``rollout.nnodes``
  1 where unset, one CPU replica per logical GPU of ``rollout.n_gpus_per_node``), the logical GPUs Ray needs for both
  pools, and weight sync over gloo (:mod:`verl_traj.cpu.weight_sync`, backend ``gloo``) where the preset's colocated
  ``naive`` sync cannot serve a separate pool.

All run in :func:`verl_traj.integration.startup.checks.check_startup`: the attention and the separate_async settings
where the CPU platform is in use (``trainer.device=cpu``), the LoRA check wherever the CPU rollout is.
"""

from __future__ import annotations

from typing import Any

from omegaconf import open_dict

from verl_traj.config import TrajConfigError
from verl_traj.integration.config.attention_names import CPU_VARLEN
from verl_traj.integration.async_modes.separate_async import is_separate_async
from verl_traj.integration.config.access import flag_at, int_at, sequence_parallel_sizes, value_at

__all__ = ["check_cpu_rollout_lora", "select_cpu_attention", "set_attention", "settle_cpu_separate_async"]

ATTN = "override_config.attn_implementation"
CUDA_ONLY_PREFIXES = ("flash_attention", "kernels-community/")


def _refuse_attention(field: str, given: Any, where: str, sp: int) -> None:
    """Refuse an attention implementation the CPU platform cannot run right (see module doc)."""
    if not isinstance(given, str):
        raise TrajConfigError(
            f"{field}={given!r} is a {type(given).__name__}, not the name of an attention implementation. Fix: set "
            f"{field}=sdpa (or {CPU_VARLEN}), or remove the override and the CPU platform selects one.", field=field)
    if sp > 1 and given != CPU_VARLEN:
        raise TrajConfigError(
            f"{field}={given!r} with Ulysses sequence parallelism ({where} ulysses_sequence_parallel_size={sp}) on the "
            f"CPU platform trains but computes something else: verl's Ulysses all-to-all wraps only the "
            f"flash-attention path, so under {given!r} each rank attends to its own slice of the sequence only. Fix: "
            f"set {field}={CPU_VARLEN} (the CPU platform's flash-attention path), or remove the override and the CPU "
            f"platform selects it.", field=field)
    if given.startswith(CUDA_ONLY_PREFIXES):
        raise TrajConfigError(
            f"{field}={given!r} is a CUDA-only attention kernel, and the CPU platform is in use (trainer.device=cpu). "
            f"Fix: set {field}=sdpa (or {CPU_VARLEN}, the flash-attention path in torch), or remove the override and "
            "the CPU platform selects one.", field=field)


def select_cpu_attention(config: Any) -> list[str]:
    """Fill ``override_config.attn_implementation`` where it is unset (``cpu_varlen`` under Ulysses, else ``sdpa``)
    and refuse a set one that is wrong on CPU, for the actor / reference model and (when on) the critic's. Returns
    the settings written (``"field=value"``)."""
    written = []
    for model_path, (where, sp) in sequence_parallel_sizes(config).items():
        field = f"{model_path}.{ATTN}"
        given = value_at(config, field)
        if given is not None:
            _refuse_attention(field, given, where, sp)
            continue
        model = value_at(config, model_path)
        if model is None:
            continue
        set_attention(model, CPU_VARLEN if sp > 1 else "sdpa")
        written.append(f"{field}={model.override_config.attn_implementation}")
    return written


def set_attention(model: Any, impl: str) -> None:
    """``model.override_config.attn_implementation = impl`` on a model config section (the key created if absent)."""
    with open_dict(model):
        if model.get("override_config", None) is None:
            model.override_config = {}
        model.override_config.attn_implementation = impl


def check_cpu_rollout_lora(config: Any) -> None:
    """LoRA (``actor_rollout_ref.model.lora_rank`` or ``lora.rank`` > 0, verl's own reading) needs
    ``actor_rollout_ref.model.lora.merge=true`` on the CPU rollout, which takes full weights only."""
    if value_at(config, "actor_rollout_ref.rollout.name") != "cpu":
        return
    rank_key = "actor_rollout_ref.model.lora.rank"
    if int_at(config, rank_key, 0) <= 0:
        rank_key = "actor_rollout_ref.model.lora_rank"
    rank = int_at(config, rank_key, 0)
    if rank > 0 and not flag_at(config, "actor_rollout_ref.model.lora.merge", False):
        raise TrajConfigError(
            f"{rank_key}={rank} trains a LoRA adapter, but the CPU rollout (actor_rollout_ref.rollout.name=cpu) loads "
            "full weights only: with actor_rollout_ref.model.lora.merge=false the actor sends the adapter alone and "
            "the first weight sync fails. Fix: add actor_rollout_ref.model.lora.merge=true (the actor merges the "
            "adapter into the base weights before each sync).", field="actor_rollout_ref.model.lora.merge")


ROLLOUT = "actor_rollout_ref.rollout"
SYNC_BACKEND = f"{ROLLOUT}.checkpoint_engine.backend"


def settle_cpu_separate_async(config: Any) -> list[str]:
    """verl's ``separate_async`` on the CPU platform: ``rollout.nnodes`` 1 where it is 0 (verl's default: no
    standalone pool), weight sync ``gloo`` where it is the colocated ``naive``, and enough logical GPUs in
    ``ray_kwargs.ray_init.num_gpus`` for the training and the rollout pools. Returns the settings written; refuses a
    weight-sync backend that needs an accelerator."""
    if not is_separate_async(config):
        return []
    written = []
    with open_dict(config):
        if int_at(config, f"{ROLLOUT}.nnodes", 0, minimum=0) == 0:
            config.actor_rollout_ref.rollout.nnodes = 1
            written.append(f"{ROLLOUT}.nnodes=1")
        backend = value_at(config, SYNC_BACKEND, "naive")
        if backend == "naive":
            config.actor_rollout_ref.rollout.checkpoint_engine.backend = "gloo"
            written.append(f"{SYNC_BACKEND}=gloo")
        elif backend != "gloo":
            raise TrajConfigError(
                f"{SYNC_BACKEND}={backend!r} on the CPU platform (trainer.device=cpu): verl's separate_async sends the "
                f"actor's weights to the standalone rollout pool through this backend, and {backend!r} needs an "
                f"accelerator. Fix: set {SYNC_BACKEND}=gloo (verl_traj's CPU weight sync), or leave the preset's "
                "naive and the CPU platform selects gloo.", field=SYNC_BACKEND)
        gpus = (int_at(config, "trainer.nnodes", 1) * int_at(config, "trainer.n_gpus_per_node", 1)
                + int_at(config, f"{ROLLOUT}.nnodes", 1) * int_at(config, f"{ROLLOUT}.n_gpus_per_node", 1))
        if int_at(config, "ray_kwargs.ray_init.num_gpus", 0) < gpus:
            config.ray_kwargs.ray_init.num_gpus = gpus
            written.append(f"ray_kwargs.ray_init.num_gpus={gpus}")
    return written
