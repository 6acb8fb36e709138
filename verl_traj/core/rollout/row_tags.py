"""Sparse per-token values as TransferQueue row tags: v1's stored row fields are fixed, so a per-token field the
trainer needs (turn rewards, GiGPO's anchor keys) travels as ``{name: [[position, value], ...]}`` on the rows that
have any, and the plan's facts put it back on its tokens with one ``index_put``. One encoding for every such field.

Pure module (torch). Values keep their Python type (an int64 anchor key stays exact; no trip through float64).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["MERGE_TAG", "STEP_ANCHOR_TAG", "TURN_REWARD_TAG", "anchor_entries", "anchor_tag", "sparse_tag", "tag_entries",
           "turn_reward_entries", "turn_reward_tag"]

# v1's row tags, written by the agent-loop worker, read by the trainer's plan facts and metrics
MERGE_TAG = "traj_merge"  # tag of a session's first row: its MergeStats as a dict
TURN_REWARD_TAG = "traj_turn_rewards"  # tag of a row with turn rewards: [[response position, reward], ...]
STEP_ANCHOR_TAG = "traj_step_anchors"  # tag of a row's calls' GiGPO anchor keys: [[response position, key], ...]


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


def turn_reward_tag(per_token: torch.Tensor) -> dict:
    """``{TURN_REWARD_TAG: [[position, reward], ...]}`` of one row's ``[n]`` turn rewards; ``{}`` when all are 0."""
    return sparse_tag(TURN_REWARD_TAG, per_token)


def turn_reward_entries(tags: list[dict]) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(row, position, reward)`` of every turn reward the rows' ``tags`` carry (``[K]`` int64, int64, float32;
    ``row`` indexes ``tags``), or ``None`` when no row has any: one ``index_put`` puts them on their tokens."""
    return tag_entries(tags, TURN_REWARD_TAG, torch.float32)


def anchor_tag(per_token: torch.Tensor) -> dict:
    """``{STEP_ANCHOR_TAG: [[position, key], ...]}`` of one row's ``[n]`` int64 anchors; ``{}`` for a row without."""
    return sparse_tag(STEP_ANCHOR_TAG, per_token)


def anchor_entries(tags: list[dict]) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(row, position, key)`` ``[K]`` int64 of every anchor the rows' ``tags`` carry, or ``None`` without any."""
    return tag_entries(tags, STEP_ANCHOR_TAG, torch.int64)
