"""A prefix tree at the model's edge: what the attention gets for one tree micro-batch, the tree-aware kernel, and the
per-tree-token outputs gathered back into rows (issue 29). The engine hooks that use them live in
:mod:`verl_traj.integration.tree.tree_forward`.

* :class:`TreeAttentionInput`: the tree's ``subtree_end`` over the whole sequence the attention sees (``N`` tree
  tokens, then verl's tail padding as one chain: :func:`padded_subtree_end`), built once a micro-batch and shared by
  every layer; on CUDA the compiled flex kernel's tree (:mod:`~verl_traj.core.kernels.tree_flex`), elsewhere the blocked
  kernel's key sets (:func:`~verl_traj.core.kernels.tree_attention.tree_attention_blocks`).
* :func:`tree_aware_attention`: a flash-attention-layout kernel made tree-aware. A call carrying the tree (model
  keyword :data:`TREE_KWARG`, which transformers hands down to every attention call, also when gradient
  checkpointing recomputes a layer) runs the exact tree attention; any other call runs the wrapped kernel after
  :func:`~verl_traj.core.kernels.tree_attention.refuse_tree_in_plain_attention` (once a forward, not a layer).
* :func:`per_row_outputs`: nested ``[1, N]`` per-tree-token outputs -> nested ``[R, L_r]`` per row.

Pure module (torch).
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Callable

import torch
from torch.profiler import record_function

from verl_traj.core.keys import TREE_KEY
from verl_traj.core.kernels.tree_attention import (TreeAttentionError, refuse_tree_in_plain_attention, tree_attention,
                                           tree_attention_blocks)
from verl_traj.core.trees.tree_facts import DeviceTree
from verl_traj.core.kernels.tree_flex import FlexTree, flex_admits, tree_attention_flex

logger = logging.getLogger(__name__)

__all__ = ["LABELED_OUTPUTS", "TREE_KWARG", "TreeAttentionInput", "padded_subtree_end", "per_row_outputs",
           "refuse_tree", "tree_aware_attention"]

TREE_KWARG = "prefix_tree_attention"  # model keyword carrying the tree to the attention
LABELED_OUTPUTS = ("log_probs",)  # outputs that depend on the rolled label (the rest are per-token functions)


def refuse_tree(what: str, fix: str) -> None:
    """Raise :class:`~verl_traj.core.kernels.tree_attention.TreeAttentionError` (field ``prefix_tree``): ``what`` the tree
    forward does not carry, and the ``fix``."""
    raise TreeAttentionError(f"prefix-tree forward: {what}. Fix: {fix}.", field=TREE_KEY)


class TreeAttentionInput:
    """One micro-batch's tree for the attention: ``subtree_end`` ``[S]`` global over the sequence the attention sees,
    built once and shared by every layer: ``flex`` on CUDA, else ``blocks``; ``calls``: attention calls served;
    ``fallbacks``: calls that took the blocked kernel because a new flex kernel would pass dynamo's recompile limit.
    A plain class: FSDP passes it through unchanged."""

    __slots__ = ("subtree_end", "blocks", "flex", "calls", "fallbacks", "block")

    def __init__(self, subtree_end: torch.Tensor, block: int = 128) -> None:
        self.subtree_end, self.block = subtree_end, block
        self.flex = FlexTree(subtree_end, block) if subtree_end.is_cuda else None
        self.blocks = None if self.flex is not None else tree_attention_blocks(subtree_end, block)
        self.calls = self.fallbacks = 0


def padded_subtree_end(subtree_end: torch.Tensor, length: int) -> torch.Tensor:
    """``[N]`` -> ``[length]``: verl's tail padding (position ids restarting at 0) as one chain after the tree."""
    n = subtree_end.numel()
    return torch.cat([subtree_end, subtree_end.new_full((length - n,), length - 1)])


def _tree_call(tree: TreeAttentionInput, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, kwargs: dict) -> torch.Tensor:
    """One attention call of a tree micro-batch: ``query`` ``[1, S, Hq, D]``, ``key`` / ``value`` ``[1, S, Hkv, D]``
    -> ``[1, S, Hq, D]`` (flash-attention's layout)."""
    extras = {k: kwargs.get(k) for k in ("sliding_window", "softcap", "s_aux") if kwargs.get(k) is not None}
    if kwargs.get("dropout") or attention_mask is not None or not kwargs.get("is_causal", True):
        extras.update(dropout=kwargs.get("dropout"), is_causal=kwargs.get("is_causal"),
                      attention_mask=None if attention_mask is None else tuple(attention_mask.shape))
    if extras:
        refuse_tree(f"the tree attention has no {sorted(extras)} ({extras})", "forward these micro-batches without "
                    "the tree (attention dropout off, no sliding window / soft-capping)")
    if query.shape[0] != 1 or query.shape[1] != tree.subtree_end.numel():
        refuse_tree(f"the attention got query {tuple(query.shape)} for a tree of {tree.subtree_end.numel()} tokens (a "
                    "sequence-parallel layout other than verl's Ulysses all-to-all?)", "forward the tree with Ulysses "
                    "or without sequence parallelism")
    scale = kwargs.get("softmax_scale")
    with record_function("verl_traj.tree.attention"):
        if tree.flex is not None and flex_admits(query[0], key[0], value[0], scale):  # CUDA: compiled flex attention
            out = tree_attention_flex(query[0], key[0], value[0], tree.flex, scale=scale)
        else:
            if tree.flex is not None:  # a new flex kernel would pass dynamo's limit: the blocked kernel, exact
                _fallback(tree)
            out = tree_attention(query[0], key[0], value[0], tree.subtree_end, scale=scale, blocks=tree.blocks)
    tree.calls += 1
    return out.unsqueeze(0)


def _fallback(tree: TreeAttentionInput) -> None:
    """Count a flex call that takes the blocked kernel (its key sets built once per tree), and warn once a process."""
    if tree.blocks is None:
        tree.blocks = tree_attention_blocks(tree.subtree_end, tree.block)
    tree.fallbacks += 1
    if not _WARNED:
        _WARNED.append(True)
        logger.warning("verl_traj: a prefix-tree micro-batch needs a flex_attention kernel past dynamo's recompile_limit="
                       "%s; it and any like it run the blocked tree kernel (exact, slower; never flex's eager path). "
                       "Counted in actor/tree_fallback_micro_batches.", torch._dynamo.config.recompile_limit)


_WARNED: list = []  # the fallback's warning, once per process


def tree_aware_attention(kernel: Callable) -> Callable:
    """``kernel`` (``_flash_attention_forward(query, key, value, attention_mask, query_length, ...)``) made
    tree-aware (module docstring); ``kernel`` itself when it already is."""
    if getattr(kernel, "_prefix_tree_aware", False):
        return kernel

    checked: list = [None]  # a weak reference to the last position_ids checked (every layer gets the same tensor)

    @functools.wraps(kernel)
    def attention(query, key, value, attention_mask, query_length, *args, **kwargs):
        tree = kwargs.pop(TREE_KWARG, None)
        if tree is not None:
            return _tree_call(tree, query, key, value, attention_mask, kwargs)
        position_ids = kwargs.get("position_ids")
        if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2 and (
                checked[0] is None or checked[0]() is not position_ids):  # one check (one sync) a forward, not a layer
            refuse_tree_in_plain_attention(position_ids, where=f"the plain attention {kernel.__name__}")
            checked[0] = weakref.ref(position_ids)
        return kernel(query, key, value, attention_mask, query_length, *args, **kwargs)

    attention._prefix_tree_aware = True
    return attention


def per_row_outputs(model_output: dict, tree: DeviceTree, offsets: torch.Tensor) -> dict:
    """Nested ``[1, N]`` per-tree-token outputs -> nested ``[R, L_r]`` per row (``offsets`` ``[R + 1]``, the rows'
    packed order, gathered through ``tree.row_index``); :data:`LABELED_OUTPUTS` get 0 at each row's last token: its
    rolled label crosses into the next packed row, and verl never reads it (``no_padding_2_padding`` drops it)."""
    out = dict(model_output)
    for key, value in model_output.items():
        if not (isinstance(value, torch.Tensor) and value.is_nested):
            continue
        values = value.values()
        flat = values[tree.row_index.to(values.device)]
        if key in LABELED_OUTPUTS:
            flat = flat.index_fill(0, (tree.row_offsets[1:] - 1).to(values.device), 0.0)
        out[key] = torch.nested.nested_tensor_from_jagged(flat, offsets)
    return out
