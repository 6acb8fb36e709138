"""Exact softmax attention over a prefix tree serialised depth-first, and the guard that keeps a tree out of an
attention that does not know trees.

Layout (the trie builder's output, taken here as plain tensors): ``N`` tree tokens in depth-first order; token
``k``'s subtree is ``[k, subtree_end[k]]`` (inclusive), so query ``q`` attends to key ``k`` iff
``k <= q <= subtree_end[k]`` (its ancestors and itself). ``position_ids[k]`` is the token's position in its own
row = its depth (number of ancestors). Invariants (:func:`check_tree`): ``k <= subtree_end[k] < N``; the intervals
nest (a subtree holds whole subtrees); ``position_ids`` equal the depths.

Packing: ``subtree_end`` is GLOBAL (indices into the packed ``N``). Trees packed one after another need nothing else:
a root's subtree ends where its tree ends, so no query of a later tree sees an earlier tree. Rows that share
nothing are separate roots (a forest = a concatenation of causal sequences). :func:`globalize_subtree_end` turns
per-tree ends plus ``cu_seqlens`` into global ones.

:func:`tree_attention` is the reference (CPU, and any device): query blocks of ``block`` tokens against exactly the
keys the block can see (``k < q1`` and ``subtree_end[k] >= q0``), matmul + masked softmax in fp32 (fp64 for fp64
inputs), and a backward that recomputes each block from the saved log-sum-exp (flash-attention style): memory kept
for backward is O(N), transient memory O(block x visible keys); no N x N tensor anywhere.
:func:`tree_block_mask` builds a flex-attention ``BlockMask`` from block-level interval facts (no N x N tensor)
for a compiled kernel on CUDA. Pure module: torch only.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
from torch.nn.attention.flex_attention import BlockMask

from verl_traj.core.errors import TrajInputError, show_value

__all__ = ["TreeAttentionError", "TreeBlocks", "tree_attention_blocks", "tree_attention", "per_row_causal_attention",
           "globalize_subtree_end", "tree_depths", "tree_attention_pairs", "check_tree", "tree_block_mask",
           "tree_branch_points", "position_resets_look_like_sequences", "refuse_tree_in_plain_attention"]


class TreeAttentionError(TrajInputError):
    """A tree layout that is invalid, or a tree batch on its way into an attention that does not know trees."""


class TreeBlocks(NamedTuple):
    """Per query block ``[i * block, min((i + 1) * block, N))``: the sorted ``int64`` indices of every key some
    query of the block can see (``keys[i]``). Built once per micro-batch, shared by every layer."""
    block: int
    n: int
    keys: tuple


def tree_attention_blocks(subtree_end: torch.Tensor, block: int = 128) -> TreeBlocks:
    """Key sets per query block of ``subtree_end`` ``[N]``: ``k < q1`` and ``subtree_end[k] >= q0`` (the union of
    the ancestors of the block's queries plus the block itself). O(N^2 / block) integer work, no N x N tensor."""
    se, n = subtree_end.long(), int(subtree_end.numel())
    keys = tuple(torch.nonzero(se[:min(q0 + block, n)] >= q0).view(-1) for q0 in range(0, n, block))
    return TreeBlocks(block, n, keys)


def _grouped(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[B, Hq, D]`` -> ``[Hkv, G * B, D]`` (query head ``h`` uses key head ``h // G``, as ``repeat_interleave``)."""
    b, hq, d = x.shape
    return x.reshape(b, hkv, hq // hkv, d).permute(1, 2, 0, 3).reshape(hkv, -1, d)


def _ungrouped(x: torch.Tensor, b: int) -> torch.Tensor:
    """Inverse of :func:`_grouped`: ``[Hkv, G * B, D]`` -> ``[B, Hkv * G, D]``."""
    hkv, gb, d = x.shape
    return x.reshape(hkv, gb // b, b, d).permute(2, 0, 1, 3).reshape(b, -1, d)


def _block_scores(q, k, v, se, q0, b, keys, scale, acc):
    """Query block ``[q0, q0 + b)``: grouped queries ``[Hkv, G*b, D]``, its keys / values ``[Hkv, nk, D]`` and the
    masked scaled scores ``[Hkv, G*b, nk]`` (``-inf`` where ``k <= q <= subtree_end[k]`` fails), all in ``acc``."""
    hkv = k.shape[1]
    qi = torch.arange(q0, q0 + b, device=q.device)[:, None]
    mask = (keys[None, :] <= qi) & (qi <= se[keys][None, :])
    qg = _grouped(q[q0:q0 + b].to(acc), hkv)
    kb, vb = k.index_select(0, keys).to(acc).transpose(0, 1), v.index_select(0, keys).to(acc).transpose(0, 1)
    s = torch.matmul(qg, kb.transpose(-1, -2)) * scale
    s.masked_fill_(~mask.repeat(qg.shape[1] // b, 1), float("-inf"))
    return qg, kb, vb, s


class TreeAttention(torch.autograd.Function):
    """``forward(q, k, v, subtree_end, blocks, scale)``; see :func:`tree_attention`. Once-differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, subtree_end, blocks: TreeBlocks, scale: float):
        acc = torch.promote_types(q.dtype, torch.float32)
        out = torch.empty_like(q)
        lse = q.new_empty(q.shape[:2] + (1,), dtype=acc)
        for i, keys in enumerate(blocks.keys):
            q0 = i * blocks.block
            b = min(blocks.block, blocks.n - q0)
            _, _, vb, s = _block_scores(q, k, v, subtree_end, q0, b, keys, scale, acc)
            lse_b = torch.logsumexp(s, dim=-1, keepdim=True)
            out[q0:q0 + b] = _ungrouped(torch.matmul(torch.exp(s - lse_b), vb), b).to(q.dtype)
            lse[q0:q0 + b] = _ungrouped(lse_b, b)
        ctx.save_for_backward(q, k, v, subtree_end, out, lse)
        ctx.blocks, ctx.scale = blocks, scale
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, se, out, lse = ctx.saved_tensors
        blocks, scale, acc = ctx.blocks, ctx.scale, lse.dtype
        dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k, v))
        hkv = k.shape[1]
        for i, keys in enumerate(blocks.keys):
            q0 = i * blocks.block
            b = min(blocks.block, blocks.n - q0)
            qg, kb, vb, s = _block_scores(q, k, v, se, q0, b, keys, scale, acc)
            p = torch.exp(s - _grouped(lse[q0:q0 + b], hkv))
            do = _grouped(d_out[q0:q0 + b].to(acc), hkv)
            delta = (do * _grouped(out[q0:q0 + b].to(acc), hkv)).sum(-1, keepdim=True)
            ds = p * (torch.matmul(do, vb.transpose(-1, -2)) - delta)
            dq[q0:q0 + b] = _ungrouped(torch.matmul(ds, kb) * scale, b)
            dk.index_add_(0, keys, (torch.matmul(ds.transpose(-1, -2), qg) * scale).transpose(0, 1))
            dv.index_add_(0, keys, torch.matmul(p.transpose(-1, -2), do).transpose(0, 1))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, subtree_end: torch.Tensor, *,
                   scale: Optional[float] = None, block: int = 128,
                   blocks: Optional[TreeBlocks] = None) -> torch.Tensor:
    """Exact tree attention: ``q`` ``[N, Hq, D]``, ``k`` / ``v`` ``[N, Hkv, D]`` (``Hq`` a multiple of ``Hkv``),
    ``subtree_end`` ``[N]`` global (module docstring) -> ``[N, Hq, D]`` in ``q``'s dtype. Query ``q`` attends to
    keys ``k <= q <= subtree_end[k]``; ``scale`` defaults to ``D ** -0.5``. Pass ``blocks`` (from
    :func:`tree_attention_blocks`, built once per micro-batch) to reuse the key sets across layers. Differentiable
    in ``q``, ``k``, ``v`` (once). Only shapes are checked here (call :func:`check_tree` once where a tree enters)."""
    n, hq, d = q.shape
    if k.shape != v.shape or k.shape[0] != n or k.shape[2] != d or hq % k.shape[1] or subtree_end.shape != (n,):
        raise TreeAttentionError(
            f"tree_attention shapes: q={tuple(q.shape)} k={tuple(k.shape)} v={tuple(v.shape)} "
            f"subtree_end={tuple(subtree_end.shape)}. Fix: q [N, Hq, D], k/v [N, Hkv, D] with Hq % Hkv == 0, "
            f"subtree_end [N].", field="subtree_end")
    if blocks is None:
        blocks = tree_attention_blocks(subtree_end, block)
    elif blocks.n != n:
        raise TreeAttentionError(f"blocks were built for N={blocks.n}, q has N={n}. Fix: rebuild them with "
                                 f"tree_attention_blocks(subtree_end).", field="blocks")
    return TreeAttention.apply(q, k, v, subtree_end.long(), blocks, d ** -0.5 if scale is None else float(scale))


def per_row_causal_attention(q_rows: Sequence[torch.Tensor], k_rows: Sequence[torch.Tensor],
                             v_rows: Sequence[torch.Tensor], *, scale: Optional[float] = None) -> list:
    """The per-row reference: each row ``q`` ``[L_i, Hq, D]``, ``k`` / ``v`` ``[L_i, Hkv, D]`` through causal
    ``scaled_dot_product_attention`` on its own -> list of ``[L_i, Hq, D]``."""
    outs = []
    for q, k, v in zip(q_rows, k_rows, v_rows):
        g = q.shape[1] // k.shape[1]
        k, v = (x.repeat_interleave(g, dim=1).transpose(0, 1) for x in (k, v))
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True, scale=scale)
        outs.append(o.transpose(0, 1))
    return outs


def globalize_subtree_end(subtree_end: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-tree ends (each relative to its tree's start) of trees packed at offsets ``cu_seqlens`` ``[T + 1]`` ->
    global ends ``[N]``."""
    cu = cu_seqlens.to(device=subtree_end.device, dtype=torch.long)
    return subtree_end.long() + torch.repeat_interleave(cu[:-1], cu.diff(), output_size=int(subtree_end.numel()))


def tree_depths(subtree_end: torch.Tensor) -> torch.Tensor:
    """``[N]`` number of ancestors of each token (= the position ids of a valid tree), in O(N)."""
    se, n = subtree_end.long(), int(subtree_end.numel())
    delta = torch.zeros(n + 2, dtype=torch.long, device=se.device)
    delta.index_add_(0, torch.arange(1, n + 1, device=se.device), torch.ones_like(se))
    delta.index_add_(0, se + 1, -torch.ones_like(se))
    return delta.cumsum(0)[:n]


def tree_attention_pairs(subtree_end: torch.Tensor) -> int:
    """Query-key pairs the tree attends (each key is seen by its whole subtree)."""
    se = subtree_end.long()
    return int((se - torch.arange(se.numel(), device=se.device) + 1).sum())


def check_tree(subtree_end: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> None:
    """Raise :class:`TreeAttentionError` unless ``subtree_end`` ``[N]`` is a depth-first tree layout: integer,
    ``k <= subtree_end[k] < N``, nested intervals (no ``j < k <= subtree_end[j] < subtree_end[k]``; O(N log N)
    range maxima), and ``position_ids`` ``[N]`` (or ``[1, N]``), when given, equal to the depths."""
    fix = "build subtree_end with the prefix-tree builder (depth-first order, inclusive subtree ends)"
    se = subtree_end
    if se.dim() != 1 or se.is_floating_point() or se.is_complex():
        raise TreeAttentionError.invalid("subtree_end", se, "is not a 1-D integer tensor", fix)
    se, n = se.long(), int(se.numel())
    idx = torch.arange(n, device=se.device)
    bad = torch.nonzero((se < idx) | (se >= n)).view(-1)
    if bad.numel():
        raise TreeAttentionError.invalid("subtree_end", se, f"has subtree_end[{int(bad[0])}]="
                                         f"{int(se[bad[0]])} outside [{int(bad[0])}, {n - 1}]", fix)
    table, span = [se], 1  # table[j][i] = max(se[i : i + 2**j])
    while 2 * span <= n:
        prev = table[-1]
        table.append(torch.maximum(prev[:-span], prev[span:]))
        span *= 2
    inner = torch.nonzero(se > idx).view(-1)  # range (k, se[k]] is non-empty
    if inner.numel():
        lo, hi = inner + 1, se[inner]
        level = torch.floor(torch.log2((hi - lo + 1).double())).long()
        width = torch.pow(2, level)
        stacked = torch.stack([torch.nn.functional.pad(t, (0, n - t.numel())) for t in table])
        inside_max = torch.maximum(stacked[level, lo], stacked[level, hi - width + 1])
        crossing = torch.nonzero(inside_max > hi).view(-1)
        if crossing.numel():
            k = int(inner[crossing[0]])
            raise TreeAttentionError.invalid("subtree_end", se, f"has a subtree [{k}, {int(se[k])}] holding part of "
                                             f"another (intervals must nest)", fix)
    if position_ids is not None:
        pos = position_ids.reshape(-1).to(se.device).long()
        depth = tree_depths(se)
        if pos.shape != depth.shape or not bool((pos == depth).all()):
            raise TreeAttentionError.invalid("position_ids", position_ids, "are not the tree depths (each token's "
                                             "position in its row)", "build position_ids with the subtree_end")


def tree_block_mask(subtree_end: torch.Tensor, block: int = 128):
    """flex-attention ``BlockMask`` (``B = H = 1``) for ``k <= q <= subtree_end[k]``, built from per-key-block
    min / max of ``subtree_end`` (O(N + (N / block)^2)): key block ``[k0, k1)`` before query block ``[q0, q1)`` is
    visible iff ``max(subtree_end) >= q0`` and fully visible iff ``min(subtree_end) >= q1 - 1``; diagonal blocks
    and blocks cut by ``N`` are partial (``mask_mod`` decides per pair)."""
    se, n = subtree_end.long(), int(subtree_end.numel())
    nb = -(-n // block)
    padded = torch.nn.functional.pad(se, (0, nb * block - n), value=-1)  # padding keys see nothing
    se_max, se_min = padded.view(nb, block).amax(-1), padded.view(nb, block).amin(-1)
    qb = torch.arange(nb, device=se.device)
    before = qb[None, :] < qb[:, None]  # [q block, k block]
    q0, q1 = qb[:, None] * block, torch.clamp((qb[:, None] + 1) * block, max=n)
    visible = (before & (se_max[None, :] >= q0)) | torch.eye(nb, dtype=torch.bool, device=se.device)
    full = before & (se_min[None, :] >= q1 - 1) & ((qb[:, None] + 1) * block <= n)
    partial = visible & ~full

    def as_indices(m):  # [nb, nb] bool -> ([1, 1, nb] counts, [1, 1, nb, nb] listed blocks first)
        order = torch.argsort(m.int(), dim=-1, descending=True, stable=True)
        return m.sum(-1).int()[None, None], order.int()[None, None]

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx <= padded[kv_idx])

    return BlockMask.from_kv_blocks(*as_indices(partial), *as_indices(full), BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(n, n))


def tree_branch_points(position_ids: torch.Tensor) -> torch.Tensor:
    """``[M, 2]`` (row, index) where a packed ``position_ids`` ``[N]`` or ``[b, N]`` DECREASES to a non-zero value:
    a sibling subtree starting at its branch depth. A plain sequence restarts at 0 and right padding repeats the
    last position, so only a tree (branching below the root) produces these."""
    pos = position_ids.reshape(1, -1) if position_ids.dim() == 1 else position_ids
    if pos.dim() != 2:
        raise TreeAttentionError.invalid("position_ids", position_ids, "is not [N] or [b, N] (multi-dimensional "
                                         "rotary ids are not checked)", "pass the text position ids [b, N]")
    down = (pos[:, 1:] < pos[:, :-1]) & (pos[:, 1:] != 0)
    found = torch.nonzero(down)
    return torch.stack([found[:, 0], found[:, 1] + 1], dim=-1)


def position_resets_look_like_sequences(position_ids: torch.Tensor) -> bool:
    """True iff every drop of ``position_ids`` goes to 0, i.e. a varlen attention that starts a sequence at each
    position 0 (verl's remove-padding / transformers' flash path) reads the batch correctly."""
    return tree_branch_points(position_ids).shape[0] == 0


def refuse_tree_in_plain_attention(position_ids: torch.Tensor, *, where: str = "the attention") -> None:
    """Raise :class:`TreeAttentionError` (field ``position_ids``) if ``position_ids`` hold a prefix tree: a plain
    varlen attention would merge each sibling subtree into the previous sequence (or, splitting at every drop,
    cut it from its ancestors) and train silently wrong."""
    points = tree_branch_points(position_ids)
    if points.shape[0]:
        row, i = (int(x) for x in points[0])
        pos = position_ids.reshape(1, -1) if position_ids.dim() == 1 else position_ids
        raise TreeAttentionError(
            f"position_ids={show_value(position_ids)} drop from {int(pos[row, i - 1])} to {int(pos[row, i])} (not 0) "
            f"at row {row}, index {i} ({points.shape[0]} such drops): a prefix-tree batch reached {where}, which "
            f"would read each branch as part of another sequence. Fix: route tree batches through the tree "
            f"attention (verl_traj.core.kernels.tree_attention.tree_attention with the tree's subtree_end), or forward the "
            f"rows unmerged.", field="position_ids")
