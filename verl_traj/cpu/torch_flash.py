"""The flash-attention path in torch, for a CUDA process without flash-attn.

verl's remove-padding path (and so the prefix tree, which sits at that path's kernel) needs transformers'
``flash_attention_2``, which needs the flash-attn package: a CUDA machine without it (an image without a package index,
a torch build flash-attn has no wheel for) cannot load the model that way. verl_traj then offers the same path under the
name :data:`TORCH_VARLEN` (``actor_rollout_ref.model.override_config.attn_implementation=torch_varlen``, and the
critic's): transformers' own flash-attention function and mask under that name, with the torch variable-length kernel
(:func:`verl_traj.cpu.attention.varlen_attention`, the CPU platform's ``cpu_varlen``) where verl's wrapper calls
flash-attn; tree micro-batches never reach it (the tree attention replaces the kernel). verl's engine log-probs fall
back without flash-attn to a Python loop over the tokens; :func:`fused_logprobs` (one fp32 ``cross_entropy``: the same
numbers) replaces it.

:func:`wanted` says where: ``VERL_TRAJ_TORCH_VARLEN=1`` / ``0`` forces it on / off; by default a CUDA process without
flash-attn and without the CPU platform. The plugin (:mod:`verl_traj.cpu.plugin`) installs it in every such process
(driver, workers, rollout servers), through the declared patches of :mod:`~verl_traj.integration.patches.process`.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Callable

import torch
import torch.nn.functional as F

from verl_traj.cpu.attention import flash_mask, flash_path, varlen_attention
from verl_traj.integration.config.attention_names import TORCH_VARLEN
from verl_traj.integration.patches.process import NOW, fused_logprobs_patches, torch_varlen_patches

__all__ = ["TORCH_VARLEN", "attention_patches", "fused_logprobs", "patches", "varlen_kernel", "wanted"]



def wanted() -> bool:
    """Whether this process gets :data:`TORCH_VARLEN` (module doc; the plugin asks only off the CPU platform)."""
    forced = os.environ.get("VERL_TRAJ_TORCH_VARLEN", "").strip().lower()
    if forced in ("0", "false", "no", "off"):
        return False
    if forced in ("1", "true", "yes", "on"):
        return True
    if importlib.util.find_spec("flash_attn") is not None:
        return False
    return torch.cuda.is_available()


def fused_logprobs(logits: Any, labels: Any, inplace_backward: bool = True) -> Any:
    """``[..., V]`` logits, ``[...]`` labels -> ``[...]`` fp32 log-probs of the labels, one ``cross_entropy``
    (flash-attn's fused kernel's numbers, without flash-attn)."""
    flat = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    return -flat.view(labels.shape)


def varlen_kernel(current: Callable) -> Callable:
    """verl's ``_flash_attention_forward`` <- the torch kernel, unless the prefix tree's wrapper is already there."""
    return current if getattr(current, "_prefix_tree_aware", False) else varlen_attention


def attention_patches(name: str = TORCH_VARLEN, when: str = NOW) -> list:
    """The declared patches that give a process the attention ``name`` (``when``: now, or ``ON_IMPORT`` of each
    module, as the plugin installs them)."""
    return torch_varlen_patches(name, lambda interface: interface.register(name, flash_path()),
                                lambda interface: interface.register(name, flash_mask()), varlen_kernel, when)


def patches(when: str = NOW) -> list:
    """:func:`attention_patches` and the vectorised log-probs: all a CUDA process without flash-attn gets."""
    return [*attention_patches(TORCH_VARLEN, when), *fused_logprobs_patches(lambda _verl: fused_logprobs, when)]
