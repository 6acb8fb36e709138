"""verl's config read the same way everywhere: nested values with their types checked, and the verl settings the
plan reads through verl's own predicates (:func:`uses_critic`, :func:`uses_reference`, :func:`ulysses_size`,
:func:`prompts_per_update`, :func:`parameter_sync_step`). Shared by the start-up checks and the adapters, so both
read a setting the same way; a verl value of the wrong type (``data.train_batch_size=abc``) is refused as a
:class:`~verl_traj.config.TrajConfigError` naming the field instead of crashing its reader.
"""

from __future__ import annotations

import warnings
from typing import Any

from omegaconf import OmegaConf

from verl.trainer.ppo.utils import need_critic, need_reference_policy

from verl_traj.config import TrajConfigError
from verl_traj.core.errors import check_int
from verl_traj.core.plan.estimators import estimator_name

__all__ = ["CURRENT_POLICY_SEQUENCE_RATIOS", "flag_at", "int_at", "parameter_sync_step", "prompts_per_update",
           "sequence_parallel_sizes", "ulysses_size", "uses_critic", "uses_reference", "value_at"]

# policy losses with a sequence ratio computed inside the actor's loss from the current policy: with step rows at
# traj.ratio_scope=trajectory the actor sums it over each trajectory's rows first (integration/workers/engine_workers.py)
CURRENT_POLICY_SEQUENCE_RATIOS = ("gspo",)


def value_at(node: Any, path: str, default: Any = None) -> Any:
    """``a.b.c`` from nested mappings / objects; ``default`` where a level is missing or None."""
    for key in path.split("."):
        if node is None:
            return default
        node = node.get(key, None) if hasattr(node, "get") else getattr(node, key, None)
    return default if node is None else node


def int_at(config: Any, path: str, default: int = 0, *, minimum: int | None = None) -> int:
    """The integer at ``path`` (``default`` where unset); anything else is refused naming the field."""
    return check_int(path, value_at(config, path, default), f"set {path} to a whole number"
                     + (f" >= {minimum}" if minimum is not None else ""), minimum=minimum, error=TrajConfigError)


def flag_at(config: Any, path: str, default: bool = False) -> bool:
    """The bool at ``path`` (``default`` where unset); a string such as ``"false"`` (truthy) is refused."""
    value = value_at(config, path, default)
    if not isinstance(value, bool):
        raise TrajConfigError(f"{path}={value!r} is a {type(value).__name__}, not a bool. Fix: set {path}=true or "
                              f"{path}=false (an unquoted YAML boolean).", field=path)
    return value


def uses_critic(config: Any) -> bool:
    """verl's ``need_critic`` (``verl/trainer/ppo/utils.py``: ``critic.enable`` where set, else on exactly for
    ``algorithm.adv_estimator=gae``) on a config whose sections may be missing, without its warning."""
    enable = None if value_at(config, "critic.enable") is None else flag_at(config, "critic.enable")
    view = OmegaConf.create({"critic": {"enable": enable},
                             "algorithm": {"adv_estimator": estimator_name(value_at(config, "algorithm.adv_estimator"))}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Disabled critic as algorithm.adv_estimator != gae", on every call
        return need_critic(view)


def uses_reference(config: Any) -> bool:
    """verl's ``need_reference_policy`` (a KL loss or a KL penalty in the reward) on a config whose sections may be
    missing."""
    view = OmegaConf.create({"algorithm": {"use_kl_in_reward": flag_at(config, "algorithm.use_kl_in_reward")},
                             "actor_rollout_ref": {"actor": {"use_kl_loss": flag_at(
                                 config, "actor_rollout_ref.actor.use_kl_loss")}}})
    return bool(need_reference_policy(view))


def ulysses_size(section: Any, path: str = "actor_rollout_ref.actor") -> int:
    """Ulysses size the engine of an actor / reference / critic ``section`` (at ``path``, for messages) runs with:
    the engine config's (``fsdp_config`` / ``fsdp``), where verl's ``FSDPActorConfig`` copies the deprecated
    top-level key when it is > 1 (the critic's top-level key is not copied: verl's critic ignores it)."""
    section = section if hasattr(section, "get") else {}
    engine_key = "fsdp" if "fsdp" in section else "fsdp_config"

    def size(key: str) -> int:
        return check_int(f"{path}.{key}", value_at(section, key, 1), f"set {path}.{key} to a whole number >= 1",
                         minimum=1, error=TrajConfigError)

    legacy = size("ulysses_sequence_parallel_size") if engine_key == "fsdp_config" else 1
    return legacy if legacy > 1 else size(f"{engine_key}.ulysses_sequence_parallel_size")


def sequence_parallel_sizes(config: Any) -> dict[str, tuple[str, int]]:
    """For each model config in use (``actor_rollout_ref.model``; ``critic.model`` when the critic is on): the
    engine section loading it with the largest Ulysses size, and that size (the reference, when used, loads the
    actor's model config)."""
    users = {"actor_rollout_ref.model": ["actor_rollout_ref.actor"] + (
        ["actor_rollout_ref.ref"] if uses_reference(config) else [])}
    if uses_critic(config):
        users["critic.model"] = ["critic"]
    return {model: max(((path, ulysses_size(value_at(config, path, {}), path)) for path in paths),
                       key=lambda item: item[1]) for model, paths in users.items()}


def parameter_sync_step(config: Any) -> int:
    """Local updates per weight sync: 1 on v0; ``trainer.v1.<trainer_mode>.parameter_sync_step`` on v1."""
    if not flag_at(config, "trainer.use_v1", False):
        return 1
    mode = value_at(config, "trainer.v1.trainer_mode", "sync")
    return int_at(config, f"trainer.v1.{mode}.parameter_sync_step", 1, minimum=1)


def prompts_per_update(config: Any) -> int:
    """Prompts per planned update: ``train_batch_size``, divided by v1's ``parameter_sync_step``."""
    train_bs = int_at(config, "data.train_batch_size", 0, minimum=0)
    sync = parameter_sync_step(config)
    if train_bs and train_bs % sync:
        mode = value_at(config, "trainer.v1.trainer_mode", "sync")
        raise TrajConfigError(
            f"data.train_batch_size={train_bs} is not a multiple of trainer.v1.{mode}.parameter_sync_step={sync}: "
            "each local update samples train_batch_size / parameter_sync_step prompts. Fix: make it a multiple.",
            field="data.train_batch_size")
    return train_bs // sync
