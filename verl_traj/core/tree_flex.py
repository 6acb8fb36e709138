"""Tree attention on CUDA through compiled ``flex_attention``: the kernel verl_traj's engine path calls for a prefix
tree on a GPU (the blocked :func:`~verl_traj.core.tree_attention.tree_attention` elsewhere).

Compiling ``flex_attention`` costs seconds; a training run forwards a tree of a new size ``N`` in every micro-batch.
Two rules keep it to one compile per (bucket, dtype, head layout):

* **Buckets.** ``N`` is padded up to a multiple of :data:`BUCKET`; each padding token is a root that sees only itself
  (``subtree_end[k] = k``), so no real query sees it and its output (ignored, zero upstream gradient) is finite.
* **One mask function per bucket.** The block mask's ``mask_mod`` reads ``subtree_end`` from one persistent buffer per
  (bucket, device), which :class:`FlexTree` overwrites in place for each micro-batch; a fresh closure per tree would
  recompile every micro-batch. Invariant: a micro-batch's forward and backward run before the next micro-batch's
  tree is built (verl's engine loop does: forward, then backward, per micro-batch; gradient checkpointing recomputes
  within that backward).

The block-level structure (which key blocks each query block sees, fully or partly) comes from
:func:`~verl_traj.core.tree_attention.tree_block_mask`'s interval facts: no ``N x N`` tensor. Pure module: torch only.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from verl_traj.core.tree_attention import TreeAttentionError, tree_block_mask

__all__ = ["BUCKET", "FlexTree", "bucketed", "tree_attention_flex"]

BUCKET = 1024  # tree sizes are padded up to a multiple of this (one compile per bucket)
_BUFFERS: dict = {}  # (padded N, device) -> the subtree_end buffer the bucket's mask function reads
_COMPILED: dict = {}


def bucketed(n: int, bucket: int = BUCKET) -> int:
    """``n`` rounded up to a multiple of ``bucket`` (at least one bucket)."""
    return max(1, -(-int(n) // bucket)) * bucket


def _buffer(padded: int, device: torch.device) -> torch.Tensor:
    key = (padded, str(device))
    if key not in _BUFFERS:
        _BUFFERS[key] = torch.empty(padded, dtype=torch.long, device=device)
    return _BUFFERS[key]


class FlexTree:
    """One micro-batch's tree for flex attention: ``n`` tree tokens padded to ``padded``, the block mask (built once,
    shared by every layer), its ``subtree_end`` written into the bucket's buffer (module docstring)."""

    def __init__(self, subtree_end: torch.Tensor, block: int = 128, bucket: int = BUCKET) -> None:
        se = subtree_end.long()
        self.n = int(se.numel())
        self.padded = bucketed(self.n, bucket)
        buf = _buffer(self.padded, se.device)
        buf[: self.n] = se
        buf[self.n:] = torch.arange(self.n, self.padded, device=se.device)
        self.block_mask = tree_block_mask(buf, block)
        mask = self.block_mask

        def mask_mod(b, h, q_idx, kv_idx, buf=buf):
            return (kv_idx <= q_idx) & (q_idx <= buf[kv_idx])

        mask.mask_mod = _stable_mask_mod(self.padded, buf, mask_mod)


_MASK_MODS: dict = {}


def _stable_mask_mod(padded: int, buf: torch.Tensor, mask_mod: Callable) -> Callable:
    """The same function object for every tree of one bucket and device (no recompile per tree)."""
    return _MASK_MODS.setdefault((padded, str(buf.device)), mask_mod)


def _flex() -> Callable:
    if "flex" not in _COMPILED:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED["flex"] = torch.compile(flex_attention, dynamic=False)
    return _COMPILED["flex"]


def tree_attention_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tree: FlexTree, *,
                        scale: Optional[float] = None) -> torch.Tensor:
    """``q`` ``[N, Hq, D]``, ``k`` / ``v`` ``[N, Hkv, D]`` -> ``[N, Hq, D]``: query ``q`` attends keys
    ``k <= q <= subtree_end[k]`` (the tree ``tree`` was built from), through compiled ``flex_attention``
    (differentiable on CUDA; on CPU forward only: torch's flex attention has no CPU backward)."""
    if q.shape[0] != tree.n or k.shape[0] != tree.n:
        raise TreeAttentionError(f"tree_attention_flex: q {tuple(q.shape)} for a tree of {tree.n} tokens. Fix: "
                                 "q / k / v [N, H, D], the tree built from their subtree_end.", field="q")
    pad = tree.padded - tree.n

    def heads_first(x: torch.Tensor) -> torch.Tensor:  # [N, H, D] -> [1, H, padded, D]
        return torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1).unsqueeze(0)

    out = _flex()(heads_first(q), heads_first(k), heads_first(v), block_mask=tree.block_mask, scale=scale,
                  enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)[: tree.n]
