"""``traj.prefix_tree`` settled at start-up (:func:`settle_prefix_tree`, from
:func:`~verl_traj.integration.startup.checks.check_startup`): ``auto`` (the default) becomes ``true`` where the tree is
exact and served, ``false`` elsewhere, written into the config and said once with the reason; ``true`` refuses, naming
the field, the value and the fix, what cannot serve it.

The tree runs where it is built and tested (docs/prefix_tree.md): verl_traj's planner and workers
(``traj.enable=true``) on either trainer, the actor, reference and (when on) critic models on verl's FSDP engine, on its
remove-padding path, with the flash-attention path's kernel (where the tree attention sits: ``cpu_varlen`` on the CPU
platform, ``flash_attention_2`` / ``_3`` on GPUs, ``torch_varlen`` on a GPU without flash-attn; under Ulysses verl's
all-to-all runs around it), no fused kernels,
and a model without attention dropout, sliding window or soft-capping (read from its ``config.json`` with the
``override_config`` on top, where the model is a local directory; a hub id is checked again inside the attention).
On the CPU platform an unset attention becomes ``cpu_varlen`` when the tree is on.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from huggingface_hub import try_to_load_from_cache
from omegaconf import open_dict

from verl_traj.config import TrajConfig, TrajConfigError
from verl_traj.core.trees.tree_cost import tree_cost_model
from verl_traj.integration.config.access import flag_at, uses_critic, value_at
from verl_traj.integration.config.attention_names import CPU_VARLEN, TORCH_VARLEN
from verl_traj.integration.engines import tree_strategies
from verl_traj.integration.startup.cpu_settings import set_attention

__all__ = ["TREE_ATTENTION", "check_prefix_tree", "settle_prefix_tree", "settled_traj_config"]

logger = logging.getLogger(__name__)

FIELD = "traj.prefix_tree"
ATTN = "override_config.attn_implementation"
TREE_ATTENTION = {"cpu": (CPU_VARLEN,), "cuda": ("flash_attention_2", "flash_attention_3", TORCH_VARLEN)}
Reason = tuple[str, str, str]  # (field, what the tree needs, the fix)


def _models(config: Any) -> dict[str, tuple[str, ...]]:
    """Each model config the tree runs on, with the engine sections that load it (the critic's when it is on)."""
    out = {"actor_rollout_ref.model": ("actor_rollout_ref.actor", "actor_rollout_ref.ref")}
    if uses_critic(config):
        out["critic.model"] = ("critic",)
    return out


def _engine(model: str, sections: tuple[str, ...], config: Any) -> list[Reason]:
    out = []
    for path in sections:
        strategy = value_at(config, f"{path}.strategy", "fsdp")
        if strategy not in tree_strategies():
            out.append((f"{path}.strategy", f"runs on an engine with a tree seam ({list(tree_strategies())}) only "
                        f"({path}.strategy={strategy!r})", f"set {path}.strategy=fsdp2"))
    if not flag_at(config, f"{model}.use_remove_padding", False):
        out.append((f"{model}.use_remove_padding", f"runs on verl's remove-padding path ({model}.use_remove_padding="
                    "false)", f"set {model}.use_remove_padding=true"))
    if flag_at(config, f"{model}.use_fused_kernels", False):
        out.append((f"{model}.use_fused_kernels", "forwards the model's hidden states through verl's own head, not "
                    "fused kernels", f"set {model}.use_fused_kernels=false"))
    return out


def _attention(model: str, config: Any, device: str) -> list[Reason]:
    """The tree attention sits at the flash-attention path's kernel (on CPU an unset attention becomes cpu_varlen)."""
    field = f"{model}.{ATTN}"
    allowed = TREE_ATTENTION["cpu" if device == "cpu" else "cuda"]
    given = value_at(config, field)
    given = (allowed[0] if device == "cpu" else "flash_attention_2") if given is None else given
    if given in allowed:
        return []
    return [(field, f"with {field}={given!r}: the tree attention replaces the flash-attention path's kernel, and "
             f"{given!r} would read a tree as separate sequences", f"set {field}={allowed[0]}")]


def _model_config_file(path: str) -> str | None:
    """The model's ``config.json`` readable now, offline: in a local directory, or a hub id's in the local cache."""
    local = os.path.join(os.path.expanduser(path), "config.json")
    if os.path.isfile(local):
        return local
    try:
        cached = try_to_load_from_cache(path, "config.json") if path and "://" not in path else None
    except ValueError:  # not a valid repo id
        cached = None
    return cached if isinstance(cached, str) else None


def _architecture(model: str, config: Any) -> list[Reason]:
    """Attention dropout, a sliding window or soft-capping in the model's ``config.json`` (``override_config`` on
    top): the tree's interval mask serves none of them. A model whose config cannot be read offline (a hub id not in
    the local cache, a remote path) is a reason too: start-up cannot rule them out (``auto``: rows, said)."""
    path = str(value_at(config, f"{model}.path") or "")
    found = _model_config_file(path)
    try:
        with open(found or "") as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return [(f"{model}.path", f"needs the model's config.json at start-up to rule out attention dropout, a sliding "
                 f"window and soft-capping, and {model}.path={path!r} has none readable offline (not a local directory "
                 "with config.json, nor a hub id in the local Hugging Face cache)",
                 f"download the model (or its config.json) and set {model}.path to that directory")]
    hf.update(dict(value_at(config, f"{model}.override_config") or {}))
    out = []
    if float(hf.get("attention_dropout") or 0) > 0:
        out.append((f"{model}.override_config.attention_dropout", f"needs attention dropout off (the model's "
                    f"attention_dropout={hf['attention_dropout']})",
                    f"set {model}.override_config.attention_dropout=0 (a leading + where override_config lacks the key)"))
    if hf.get("sliding_window") and hf.get("use_sliding_window", True):  # Qwen2 keeps a window it does not use
        out.append((f"{model}.override_config.use_sliding_window", f"does not serve a sliding window (the model's "
                    f"sliding_window={hf['sliding_window']})", "train this model on rows"))
    for key in ("attn_logit_softcapping", "attention_logit_softcapping"):
        if hf.get(key):
            out.append((f"{model}.override_config.{key}", f"does not serve attention soft-capping (the model's "
                        f"{key}={hf[key]})", "train this model on rows"))
    return out


def _reasons(traj_config: TrajConfig, config: Any, device: str) -> list[Reason]:
    """Everything that keeps the tree from serving ``config`` (empty: the tree is exact and served)."""
    if not traj_config.enable:
        return [("traj.enable", "needs verl_traj's planner and workers, and traj.enable=false runs stock verl",
                 "set traj.enable=true")]
    out = []
    for model, sections in _models(config).items():
        out += _engine(model, sections, config) + _attention(model, config, device) + _architecture(model, config)
    return out


def _settle(config: Any, trees: bool, device: str) -> None:
    """``traj.prefix_tree`` <- ``trees`` in the config (and cpu_varlen on CPU where the attention is unset)."""
    if trees and device == "cpu":
        for model in _models(config):
            if value_at(config, f"{model}.{ATTN}") is None:
                set_attention(value_at(config, model), CPU_VARLEN)
    with open_dict(config):
        if config.get("traj") is None:
            config.traj = {}
        config.traj.prefix_tree = trees
    TrajConfig.forget(config)


def settle_prefix_tree(traj_config: TrajConfig, config: Any, device: str) -> str:
    """Settle ``traj.prefix_tree`` in ``config`` (module doc); returns what ``auto`` chose and why (``""`` for an
    explicit value). Raises :class:`TrajConfigError` naming the field for ``true`` where the tree is not served."""
    mode = traj_config.prefix_tree
    if mode is False:
        return ""
    reasons = _reasons(traj_config, config, device)
    if mode is True:
        if reasons:
            field, what, fix = reasons[0]
            raise TrajConfigError(f"traj.prefix_tree=true {what}. Fix: {fix}, or set traj.prefix_tree=false.",
                                  field=field)
        _settle(config, True, device)
        return ""
    _settle(config, not reasons, device)
    if reasons:
        field, what, fix = reasons[0]
        named = "" if field in what else f" ({field})"
        return (f"traj.prefix_tree=auto: rows, because the prefix tree {what}{named}. To forward every shared prefix "
                f"once: {fix}.")
    cost = tree_cost_model(device, traj_config.tree_token_cost, traj_config.tree_margin)
    return ("traj.prefix_tree=auto: prefix trees (verl's FSDP engine, remove-padding, the flash-attention path's "
            "kernel): every prefix a micro-batch's rows share is forwarded once, in each micro-batch that shares at "
            f"least {cost.break_even_sharing(1e12):.0%} of its row tokens (the {device} cost model's break-even: "
            "traj.tree_token_cost, traj.tree_margin), the others as rows. traj.prefix_tree=false for rows.")


def settled_traj_config(config: Any) -> TrajConfig:
    """A trainer's ``traj:`` section with ``prefix_tree`` settled: start-up settles it in the config; a trainer built
    without start-up (a script, a test) settles it here, the same way, and says so."""
    traj_config = TrajConfig.of(config)
    if traj_config.prefix_tree != "auto":
        return traj_config
    message = settle_prefix_tree(traj_config, config, "cpu" if value_at(config, "trainer.device") == "cpu" else "cuda")
    logger.warning("verl_traj: %s", message)
    return TrajConfig.of(config)


def check_prefix_tree(traj_config: TrajConfig, config: Any, device: str) -> None:
    """:func:`settle_prefix_tree` without its message (refusals raise; ``auto`` is settled in ``config``)."""
    settle_prefix_tree(traj_config, config, device)
