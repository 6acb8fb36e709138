"""Step rows held flat: every row's prompt tokens in one tensor, every row's response-side values in others, with
per-row lengths. Reordering, concatenation and padding into verl's layout are index arithmetic over those tensors
(no Python loop over rows or tokens); :func:`from_merged_rows` converts the per-trajectory path's rows.

Pure module: torch, numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional, Sequence

import numpy as np
import torch

from verl_traj.stepwise.prefix_merge import MergedRow

__all__ = ["STEP_ANCHOR", "TREE_CALL", "TREE_OUTCOME", "TURN_REWARD", "FlatRows", "cat_rows", "filled",
           "from_merged_rows", "padded", "row_index_array", "segment_index"]

TURN_REWARD = "turn_reward"  # per-token values of a step row: each call's own reward on its last response token
STEP_ANCHOR = "step_anchor"  # per-token int64 of a step row: each call's anchor key on its first response token
# per-token values of a branching session's rows (issue 56), on each call's first response token: its packed leaf span
# (stepwise.call_tree.pack_leaf_span) and, at a leaf with its own outcome, that outcome
TREE_CALL = "tree_call"
TREE_OUTCOME = "tree_outcome"


def segment_index(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[sum(lengths)]`` int64: ``starts[i], ..., starts[i] + lengths[i] - 1`` for every ``i``, concatenated."""
    lengths = lengths.long()
    total = int(lengths.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.long)
    out_start = torch.cumsum(lengths, 0) - lengths
    return torch.arange(total) + torch.repeat_interleave(starts.long() - out_start, lengths, output_size=total)


def _starts(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(lengths, 0) - lengths


@dataclass(frozen=True)
class FlatRows:
    """``N`` step rows (a row: one LLM call, or consecutive calls merged), unpadded and concatenated.

    Invariants: ``prompt`` holds ``prompt_len.sum()`` tokens and every response-side tensor ``response_len.sum()``
    entries, rows in order; ``mask`` is 0/1 (1 on the calls' loss tokens, 0 on observations), ``log_probs`` and
    ``turn_reward`` are 0 on observations, ``anchor`` holds each call's key on its first response token, 0 elsewhere.
    """

    prompt: torch.Tensor  # [sum P] int64
    prompt_len: torch.Tensor  # [N] int64
    response: torch.Tensor  # [sum Q] int64
    response_len: torch.Tensor  # [N] int64
    mask: torch.Tensor  # [sum Q] int64
    log_probs: Optional[torch.Tensor]  # [sum Q] float32 (None: the batch has no rollout log-probs)
    turn_reward: torch.Tensor  # [sum Q] float32
    anchor: Optional[torch.Tensor]  # [sum Q] int64 (None: not asked for)
    tree_call: Optional[torch.Tensor]  # [sum Q] int64 packed leaf spans (None: no branching session among the rows)
    tree_outcome: Optional[torch.Tensor]  # [sum Q] float32 leaves' own outcomes (None with tree_call)
    source_row: torch.Tensor  # [N] int64: the input row each row came from
    step_index: torch.Tensor  # [N] int64: the row's index among its trajectory's rows
    first_step: torch.Tensor  # [N] int64: the first and last LLM call (record index) merged into the row
    last_step: torch.Tensor  # [N] int64
    is_last: torch.Tensor  # [N] bool: the row holds its trajectory's last call

    @property
    def num_rows(self) -> int:
        return int(self.prompt_len.numel())

    def take(self, index: torch.Tensor) -> "FlatRows":
        """Rows ``index`` (a permutation or selection), in that order."""
        p = segment_index(_starts(self.prompt_len)[index], self.prompt_len[index])
        q = segment_index(_starts(self.response_len)[index], self.response_len[index])
        per_row = {f.name: getattr(self, f.name)[index] for f in fields(self) if f.name in _PER_ROW}
        per_token = {name: None if getattr(self, name) is None else getattr(self, name)[q] for name in _PER_TOKEN}
        return replace(self, prompt=self.prompt[p], **per_token, **per_row)

    def in_source_order(self) -> "FlatRows":
        """Rows grouped by source row, each trajectory's rows in step order."""
        key = self.source_row * (int(self.step_index.max()) + 1 if self.num_rows else 1) + self.step_index
        order = torch.argsort(key, stable=True)
        return self if bool((order == torch.arange(order.numel())).all()) else self.take(order)


_PER_ROW = ("prompt_len", "response_len", "source_row", "step_index", "first_step", "last_step", "is_last")
_PER_TOKEN = ("response", "mask", "log_probs", "turn_reward", "anchor", "tree_call", "tree_outcome")
_TREE = {"tree_call": torch.long, "tree_outcome": torch.float32}  # per-token fields a part without trees fills with 0


def cat_rows(parts: Sequence[FlatRows]) -> FlatRows:
    """The rows of ``parts`` one after the other (all with or all without log-probs / anchors; the tree fields of a
    part without branching sessions are 0)."""
    parts = [p for p in parts if p is not None]
    if len(parts) == 1:
        return parts[0]
    out = {}
    for f in fields(FlatRows):
        values = [getattr(p, f.name) for p in parts]
        if f.name in _TREE and any(v is not None for v in values):
            values = [torch.zeros(int(p.response_len.sum()), dtype=_TREE[f.name]) if v is None else v
                      for p, v in zip(parts, values)]
        out[f.name] = None if values[0] is None else torch.cat(values)
    return FlatRows(**out)


def from_merged_rows(rows: Sequence[tuple[int, MergedRow]], has_lp: bool, anchors: bool) -> FlatRows:
    """The per-trajectory path's rows (``(source row, row)`` pairs, any order) as flat rows."""
    def cat(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat(values).to(dtype) if values else torch.zeros(0, dtype=dtype)

    def long(values) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.long)

    rs = [r for _, r in rows]
    tree = any(TREE_CALL in r.per_token for r in rs)

    def tree_field(name: str, dtype: torch.dtype) -> Optional[torch.Tensor]:
        return cat([r.per_token.get(name, torch.zeros(r.response_ids.numel())) for r in rs], dtype) if tree else None

    return FlatRows(
        prompt=cat([r.prompt_ids for r in rs], torch.long), prompt_len=long(r.prompt_ids.numel() for r in rs),
        response=cat([r.response_ids for r in rs], torch.long), response_len=long(r.response_ids.numel() for r in rs),
        mask=cat([r.response_mask for r in rs], torch.long),
        log_probs=cat([r.per_token["lp"] for r in rs], torch.float32) if has_lp else None,
        turn_reward=cat([r.per_token[TURN_REWARD] for r in rs], torch.float32),
        anchor=cat([r.per_token[STEP_ANCHOR] for r in rs], torch.long) if anchors else None,
        tree_call=tree_field(TREE_CALL, torch.long), tree_outcome=tree_field(TREE_OUTCOME, torch.float32),
        source_row=long(b for b, _ in rows), step_index=long(r.step_index for r in rs),
        first_step=long(r.source_steps[0] for r in rs), last_step=long(r.source_steps[-1] for r in rs),
        is_last=torch.tensor([r.is_last_step for r in rs], dtype=torch.bool))


def padded(values: torch.Tensor, lengths: torch.Tensor, width: int, *, left: bool, fill=0,
           dtype: Optional[torch.dtype] = None, where: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[N, width]``: row ``i`` holds the next ``lengths[i]`` entries of ``values``, left- or right-aligned, ``fill``
    elsewhere (``lengths <= width``). ``where``: :func:`filled` of the lengths, when the caller has it."""
    where = filled(lengths, width, left=left) if where is None else where
    out = torch.full(tuple(where.shape), fill, dtype=dtype or values.dtype)
    return out.masked_scatter_(where, values.to(out.dtype))


def filled(lengths: torch.Tensor, width: int, *, left: bool) -> torch.Tensor:
    """``[N, width]`` bool: the positions a row of ``lengths[i]`` entries fills, left- or right-aligned."""
    col = torch.arange(width).unsqueeze(0)
    return col >= (width - lengths).unsqueeze(1) if left else col < lengths.unsqueeze(1)


def row_index_array(values: Sequence, source_row: torch.Tensor) -> np.ndarray:
    """``[N]`` object array: ``values[source_row[i]]`` (one entry per source row, repeated onto its rows)."""
    per_source = np.empty(len(values), dtype=object)
    per_source[:] = list(values)
    return per_source[source_row.numpy()]
