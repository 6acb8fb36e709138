"""The flash-attention path in torch, for a CUDA process without flash-attn.

verl's remove-padding path (and so the prefix tree, which sits at that path's kernel) needs transformers'
``flash_attention_2``, which needs the flash-attn package: a CUDA machine without it (an image without a package index,
a torch build flash-attn has no wheel for) cannot load the model that way. verl_traj then offers the same path under the
name :data:`TORCH_VARLEN` (``actor_rollout_ref.model.override_config.attn_implementation=torch_varlen``, and the
critic's): transformers' own flash-attention function and mask under that name, with the torch variable-length kernel
(:func:`verl_traj.cpu.attention.varlen_attention`, the CPU platform's ``cpu_varlen``) where verl's wrapper calls
flash-attn; tree micro-batches never reach it (the tree attention replaces the kernel). verl's engine log-probs fall
back without flash-attn to a Python loop over the tokens; the chunked fp32 log-softmax
(:func:`~verl_traj.core.kernels.chunked_logprobs.chunked_logprobs`: the same numbers, bounded scratch) replaces it.

:func:`wanted` says where: ``VERL_TRAJ_TORCH_VARLEN=1`` / ``0`` forces it on / off; by default a CUDA process without
flash-attn and without the CPU platform. The plugin (:mod:`verl_traj.cpu.plugin`) only *registers the names* in every
such process (:func:`patches`): nothing of verl's changes on ``import verl``. The kernel and the log-probs replace
verl's (:func:`install_kernels`) when the ``torch_varlen`` attention is first called, i.e. in a process whose model
selected it; explicit installs (:func:`attention_patches`: ``scripts/bench_update.py``, the tests) do both at once.
All through the declared patches of :mod:`~verl_traj.integration.patches.process`.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any, Callable

import torch

from verl_traj.core.kernels.chunked_logprobs import chunked_logprobs
from verl_traj.core.kernels.tree_kernel import tree_aware_attention
from verl_traj.cpu.attention import flash_mask, flash_path, varlen_attention
from verl_traj.integration.config.attention_names import TORCH_VARLEN
from verl_traj.integration.patches.process import (NOW, REGISTER, fused_logprobs_patches, install,
                                                   torch_varlen_patches)

__all__ = ["TORCH_VARLEN", "attention_patches", "install_kernels", "patches", "varlen_kernel", "wanted"]


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


def varlen_kernel(current: Callable) -> Callable:
    """verl's ``_flash_attention_forward`` <- the torch kernel; where the prefix tree's wrapper is already there (a tree
    pass ran first), the wrapper of the torch kernel, so a call without a tree never reaches flash-attn."""
    return tree_aware_attention(varlen_attention) if getattr(current, "_prefix_tree_aware", False) else varlen_attention


def _kernel_patches(name: str, when: str) -> list:
    """verl's functions replaced: ``_flash_attention_forward`` <- the torch kernel, the engine's log-probs <- chunked."""
    return [*(p for p in _named(name, when) if p.kind != REGISTER),
            *fused_logprobs_patches(lambda _verl: chunked_logprobs, when)]


def _named(name: str, when: str) -> list:
    attention = _installing_kernels(flash_path())
    return torch_varlen_patches(name, lambda interface: interface.register(name, attention),
                                lambda interface: interface.register(name, flash_mask()), varlen_kernel, when)


@functools.cache
def install_kernels() -> None:
    """:func:`_kernel_patches` in this process, now, once (the ``torch_varlen`` attention's first call)."""
    install(_kernel_patches(TORCH_VARLEN, NOW), on_import=None)


def _installing_kernels(attention: Callable) -> Callable:
    """``attention`` that installs the kernels at its first call (then a cached no-op per call)."""
    @functools.wraps(attention)
    def torch_varlen_attention(*args: Any, **kwargs: Any) -> Any:
        install_kernels()
        return attention(*args, **kwargs)

    return torch_varlen_attention


def attention_patches(name: str = TORCH_VARLEN, when: str = NOW) -> list:
    """Everything that gives a process the attention ``name`` at once: its names and the kernels (explicit installs:
    ``scripts/bench_update.py``, the tests)."""
    return [*_named(name, when), *fused_logprobs_patches(lambda _verl: chunked_logprobs, when)]


def patches(when: str = NOW) -> list:
    """What the plugin installs in a CUDA process without flash-attn: the names only (registrations in transformers'
    attention and mask interfaces); the kernels follow at the attention's first call (:func:`install_kernels`)."""
    return [p for p in _named(TORCH_VARLEN, when) if p.kind == REGISTER]
