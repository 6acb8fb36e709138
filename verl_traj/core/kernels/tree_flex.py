"""Tree attention on CUDA through compiled ``flex_attention``: the kernel verl_traj's engine path calls for a prefix
tree on a GPU (the blocked :func:`~verl_traj.core.kernels.tree_attention.tree_attention` elsewhere).

Compiling ``flex_attention`` costs seconds, and dynamo keeps at most ``torch._dynamo.config.recompile_limit`` (8)
compiled entries per code object: past it, torch would run ``flex_attention`` eagerly, materialising the whole
``[H, N, N]`` score matrix (out of memory, or a crawl, at a 16K-token micro-batch). So a whole run compiles a bounded,
known number of kernels, whatever its tree sizes:

* **Dynamic lengths.** The kernel is compiled once with a symbolic sequence length (``dynamic=True``): every tree size
  reuses it. ``N`` is still padded up to a multiple of :data:`BUCKET` (each padding token a root that sees only
  itself, ``subtree_end[k] = k``: no real query sees it, its output is ignored and finite), which keeps the lengths
  on a grid the compiled kernel is known to take (torch 2.13's CPU flex template fails to compile symbolic lengths of
  384 or 1,000; :func:`flex_tree_attention` refuses lengths off the grid) and costs only the padding queries' diagonal
  blocks.
* **One kernel per** :class:`FlexKernel` **key** (device, dtype, head layout, scale, grad mode, which inputs need
  grad): a training run has two per dtype (the no-grad passes and the update). The keys seen are counted
  (:func:`flex_kernels`); a call that would compile a new kernel past the recompile limit raises
  :class:`TreeAttentionError` before compiling (the engine's tree call asks :func:`flex_admits` first and takes the
  blocked kernel instead: :mod:`~verl_traj.core.kernels.tree_kernel`), and the kernel is compiled with ``fullgraph=True``, so a limit hit
  dynamo reaches anyway (say another user of ``flex_attention`` in the process filled its cache) raises too, never
  the eager path. No global dynamo setting is changed.

Each tree's block mask carries its own ``mask_mod`` closure over that tree's ``subtree_end`` (a new closure costs no
recompile: dynamo guards the function's code and the tensor's metadata, not its identity), so trees of consecutive
micro-batches share no buffer. The block-level structure comes from
:func:`~verl_traj.core.kernels.tree_attention.tree_block_mask`'s interval facts: no ``N x N`` tensor. Pure module: torch only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch._dynamo.exc import FailOnRecompileLimitHit
from torch.nn.attention.flex_attention import flex_attention

from verl_traj.core.kernels.tree_attention import TreeAttentionError, tree_block_mask

__all__ = ["BUCKET", "FlexKernel", "FlexTree", "bucketed", "flex_admits", "flex_kernels", "flex_tree_attention",
           "tree_attention_flex"]

BUCKET = 1024  # tree sizes are padded up to a multiple of this (block-aligned lengths; no compile per size)
_COMPILED: dict = {}
_KERNELS: set = set()  # FlexKernel keys called so far in this process (dynamo's compiled cache is per process too)


def bucketed(n: int, bucket: int = BUCKET) -> int:
    """``n`` rounded up to a multiple of ``bucket`` (at least one bucket)."""
    return max(1, -(-int(n) // bucket)) * bucket


@dataclass(frozen=True)
class FlexKernel:
    """What dynamo compiles one ``flex_attention`` kernel for (the sequence length is symbolic, so not part of it)."""
    device: str
    dtype: torch.dtype
    heads: tuple  # (Hq, Hkv, D)
    scale: Optional[float]
    grad_enabled: bool
    requires_grad: tuple  # (q, k, v)


def flex_kernels() -> frozenset:
    """The :class:`FlexKernel` keys :func:`flex_tree_attention` has been called with in this process."""
    return frozenset(_KERNELS)


class FlexTree:
    """One micro-batch's tree for flex attention: ``n`` tree tokens padded to ``padded`` (a multiple of
    :data:`BUCKET`) with single-token roots, and its block mask (built once, shared by every layer; its ``mask_mod``
    reads this tree's padded ``subtree_end``, ``[padded]``)."""

    def __init__(self, subtree_end: torch.Tensor, block: int = 128) -> None:
        se = subtree_end.long()
        self.n = int(se.numel())
        self.padded = bucketed(self.n)
        tail = torch.arange(self.n, self.padded, device=se.device)
        self.block_mask = tree_block_mask(torch.cat([se, tail]), block)


def _flex() -> Callable:
    if "flex" not in _COMPILED:
        _COMPILED["flex"] = torch.compile(flex_attention, dynamic=True, fullgraph=True)
    return _COMPILED["flex"]


def _key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float]) -> FlexKernel:
    """The kernel a call compiles for: ``q`` ``[., Hq, ., D]`` / ``[N, Hq, D]`` alike (heads at dim 1)."""
    return FlexKernel(str(q.device), q.dtype, (q.shape[1], k.shape[1], q.shape[-1]), scale, torch.is_grad_enabled(),
                      (q.requires_grad, k.requires_grad, v.requires_grad))


def flex_admits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None) -> bool:
    """Whether a :func:`tree_attention_flex` call on ``q`` / ``k`` / ``v`` (``[N, H, D]``) runs a compiled kernel: one
    compiled already, or a new one within dynamo's recompile limit (else the caller takes the blocked kernel)."""
    return _key(q, k, v, scale) in _KERNELS or len(_KERNELS) < int(torch._dynamo.config.recompile_limit)


def _admit(key: FlexKernel) -> None:
    """Count ``key``; raise if it is a new kernel past dynamo's recompile limit (the module docstring)."""
    limit = int(torch._dynamo.config.recompile_limit)
    if key not in _KERNELS and len(_KERNELS) >= limit:
        raise TreeAttentionError(
            f"tree_attention_flex: a call needs flex kernel {len(_KERNELS) + 1} ({key}) past dynamo's recompile_limit="
            f"{limit}; already compiled: {sorted(map(str, _KERNELS))}. torch would run flex_attention eagerly "
            "(the whole [H, N, N] score matrix). Fix: keep one dtype, head layout and softmax scale per process, or "
            "raise torch._dynamo.config.recompile_limit for this run.", field="q")
    _KERNELS.add(key)


def flex_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask, *,
                        scale: Optional[float] = None) -> torch.Tensor:
    """``q`` ``[1, Hq, L, D]``, ``k`` / ``v`` ``[1, Hkv, L, D]`` -> ``[1, Hq, L, D]``, ``L`` a multiple of
    :data:`BUCKET` (:class:`FlexTree` pads to one): the compiled ``flex_attention`` (symbolic ``L``, ``fullgraph``)
    with ``block_mask``, never its eager path: a new kernel past the recompile limit raises
    :class:`TreeAttentionError` (the module docstring)."""
    if q.dim() != 4 or q.shape[2] % BUCKET or k.shape[2] != q.shape[2]:
        raise TreeAttentionError(f"flex_tree_attention: q {tuple(q.shape)}, k {tuple(k.shape)}: not [1, H, L, D] with "
                                 f"L a multiple of {BUCKET} (only those lengths share the compiled kernel). Fix: pad "
                                 "the tree with FlexTree and call tree_attention_flex.", field="q")
    key = _key(q, k, v, scale)
    _admit(key)
    try:
        return _flex()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    except FailOnRecompileLimitHit as e:
        raise TreeAttentionError(
            f"tree_attention_flex: dynamo reached its recompile_limit={torch._dynamo.config.recompile_limit} for "
            f"flex_attention at kernel {key} (verl_traj's own flex calls used {len(_KERNELS)} kernels: another "
            "compiled flex_attention in this process shares the cache). Fix: compile fewer flex_attention variants "
            "in this process, or raise torch._dynamo.config.recompile_limit for this run.", field="q") from e


def tree_attention_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tree: FlexTree, *,
                        scale: Optional[float] = None) -> torch.Tensor:
    """``q`` ``[N, Hq, D]``, ``k`` / ``v`` ``[N, Hkv, D]`` -> ``[N, Hq, D]``: query ``q`` attends keys
    ``k <= q <= subtree_end[k]`` (the tree ``tree`` was built from), through :func:`flex_tree_attention`
    (differentiable on CUDA; on CPU forward only: torch's flex attention has no CPU backward)."""
    if q.shape[0] != tree.n or k.shape[0] != tree.n:
        raise TreeAttentionError(f"tree_attention_flex: q {tuple(q.shape)} for a tree of {tree.n} tokens. Fix: "
                                 "q / k / v [N, H, D], the tree built from their subtree_end.", field="q")
    pad = tree.padded - tree.n

    def heads_first(x: torch.Tensor) -> torch.Tensor:  # [N, H, D] -> [1, H, padded, D]
        return torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1).unsqueeze(0)

    out = flex_tree_attention(heads_first(q), heads_first(k), heads_first(v), tree.block_mask, scale=scale)
    return out[0].transpose(0, 1)[: tree.n]
