"""Sparse per-token values as TransferQueue row tags: v1's stored row fields are fixed, so a per-token field the
trainer needs (turn rewards, GiGPO's anchor keys) travels as ``{name: [[position, value], ...]}`` on the rows that
have any, and the plan's facts put it back on its tokens with one ``index_put``. One encoding for every such field.

Pure module (torch). Values keep their Python type (an int64 anchor key stays exact; no trip through float64).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["sparse_tag", "tag_entries"]


def sparse_tag(name: str, per_token: torch.Tensor) -> dict:
    """``{name: [[position, value], ...]}`` of one row's ``[n]`` values where they are non-zero; ``{}`` if none."""
    pos = per_token.nonzero().flatten()
    return {name: [list(pair) for pair in zip(pos.tolist(), per_token[pos].tolist())]} if pos.numel() else {}


def tag_entries(tags: list[dict], name: str, dtype: torch.dtype) -> Optional[tuple[torch.Tensor, torch.Tensor,
                                                                                      torch.Tensor]]:
    """``(row, position, value)`` ``[K]`` (int64, int64, ``dtype``) of every entry the rows' ``tags`` carry under
    ``name`` (``row`` indexes ``tags``), or ``None`` when no row has any."""
    tagged = [(b, t[name]) for b, t in enumerate(tags) if t.get(name)]
    if not tagged:
        return None
    rows = torch.cat([torch.full((len(e),), b, dtype=torch.int64) for b, e in tagged])
    pairs = [pair for _, e in tagged for pair in e]
    return (rows, torch.tensor([int(p) for p, _ in pairs], dtype=torch.int64),
            torch.tensor([v for _, v in pairs], dtype=dtype))
