"""What ``traj.prefix_tree=true`` needs, checked at start-up (:func:`check_prefix_tree`, from
:func:`~verl_traj.integration.startup.check_startup`), each refusal naming the field, the value and the fix.

The tree runs where it is built and tested (docs/prefix_tree.md): verl_traj's planner and workers
(``traj.enable=true``) on either trainer, the actor, reference and (when on) critic models on verl's FSDP engine, on its
remove-padding path, with the flash-attention path's kernel (where the tree attention sits: ``cpu_varlen`` on the CPU
platform, ``flash_attention_2`` / ``_3`` on GPUs; under Ulysses verl's all-to-all runs around it) and no fused
kernels. On the CPU platform an unset attention becomes ``cpu_varlen``.
"""

from __future__ import annotations

from typing import Any

from verl_traj.config import TrajConfig, TrajConfigError
from verl_traj.cpu.attention import CPU_VARLEN
from verl_traj.cpu.settings import set_attention
from verl_traj.integration.verl_checks import flag_at, uses_critic, value_at

__all__ = ["TREE_ATTENTION", "check_prefix_tree"]

FIELD = "traj.prefix_tree"
ATTN = "override_config.attn_implementation"
TREE_ATTENTION = {"cpu": (CPU_VARLEN,), "cuda": ("flash_attention_2", "flash_attention_3")}


def _refuse(what: str, fix: str, field: str = FIELD) -> None:
    raise TrajConfigError(f"traj.prefix_tree=true {what}. Fix: {fix}, or set traj.prefix_tree=false.", field=field)


def _check_trainer(traj_config: TrajConfig, config: Any) -> None:
    if not traj_config.enable:
        _refuse("needs verl_traj's planner and workers, and traj.enable=false runs stock verl", "set traj.enable=true",
                "traj.enable")


def _models(config: Any) -> dict[str, tuple[str, ...]]:
    """Each model config the tree runs on, with the engine sections that load it (the critic's when it is on)."""
    out = {"actor_rollout_ref.model": ("actor_rollout_ref.actor", "actor_rollout_ref.ref")}
    if uses_critic(config):
        out["critic.model"] = ("critic",)
    return out


def _check_engine(model: str, sections: tuple[str, ...], config: Any) -> None:
    for path in sections:
        strategy = value_at(config, f"{path}.strategy", "fsdp")
        if strategy not in ("fsdp", "fsdp2"):
            _refuse(f"runs on verl's FSDP engine only ({path}.strategy={strategy!r})", f"set {path}.strategy=fsdp2",
                    f"{path}.strategy")
    if not flag_at(config, f"{model}.use_remove_padding", False):
        _refuse(f"runs on verl's remove-padding path ({model}.use_remove_padding=false)",
                f"add {model}.use_remove_padding=true", f"{model}.use_remove_padding")
    if flag_at(config, f"{model}.use_fused_kernels", False):
        _refuse("forwards the model's hidden states through verl's own head, not fused kernels",
                f"set {model}.use_fused_kernels=false", f"{model}.use_fused_kernels")


def _check_attention(model: str, config: Any, device: str) -> None:
    """The tree attention sits at the flash-attention path's kernel; on CPU an unset attention becomes cpu_varlen."""
    field = f"{model}.{ATTN}"
    allowed = TREE_ATTENTION["cpu" if device == "cpu" else "cuda"]
    given = value_at(config, field)
    if given is None and device == "cpu":
        set_attention(value_at(config, model), CPU_VARLEN)
        return
    given = "flash_attention_2" if given is None else given  # verl's default on GPUs
    if given not in allowed:
        _refuse(f"with {field}={given!r}: the tree attention replaces the flash-attention path's kernel, and "
                f"{given!r} would read a tree as separate sequences", f"set {field}={allowed[0]}", field)


def check_prefix_tree(traj_config: TrajConfig, config: Any, device: str) -> None:
    """Refuse ``traj.prefix_tree=true`` where it is not built or tested (module doc); nothing when it is off."""
    if not traj_config.prefix_tree:
        return
    _check_trainer(traj_config, config)
    for model, sections in _models(config).items():
        _check_engine(model, sections, config)
        _check_attention(model, config, device)
