"""Sparse per-token values as TransferQueue row tags: v1's stored row fields are fixed, so a per-token field the
trainer needs (turn rewards, GiGPO's anchor keys) travels as ``{name: [[position, value], ...]}`` on the rows that
have any, and the plan's facts put it back on its tokens with one ``index_put``. One encoding for every such field.

Pure module (torch). Values keep their Python type (an int64 anchor key stays exact; no trip through float64).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from verl_traj.core.trees.prefix_hashes import prefix_block_hashes
from verl_traj.core.trees.token_rows import TokenRows

__all__ = ["LOSS_TOKENS_TAG", "MERGE_TAG", "PREFIX_HASH_TAG", "STEP_ANCHOR_TAG", "TREE_CALLS_TAG", "TREE_OUTCOMES_TAG",
           "TURN_REWARD_TAG", "anchor_entries",
           "anchor_tag", "row_fact_tags", "sparse_tag", "tag_entries", "tagged_hashes", "tagged_loss_tokens",
           "turn_reward_entries", "turn_reward_tag"]

# v1's row tags, written by the agent-loop worker, read by the trainer's plan facts and metrics
MERGE_TAG = "traj_merge"  # tag of a session's first row: its MergeStats as a dict
TURN_REWARD_TAG = "traj_turn_rewards"  # tag of a row with turn rewards: [[response position, reward], ...]
STEP_ANCHOR_TAG = "traj_step_anchors"  # tag of a row's calls' GiGPO anchor keys: [[response position, key], ...]
# tags of a branching session's rows (issue 56): each call's packed leaf span and a leaf's own outcome, each on the
# call's first response position (core.keys.TREE_CALLS / TREE_OUTCOMES)
TREE_CALLS_TAG = "traj_tree_calls"
TREE_OUTCOMES_TAG = "traj_tree_outcomes"
# every training row's facts, recorded where it is written so the trainer's plan reads no per-token field of it
LOSS_TOKENS_TAG = "traj_loss_tokens"  # the row's loss tokens (its response_mask's sum) as written
PREFIX_HASH_TAG = "traj_prefix_hashes"  # its prefix block hashes (core/trees/prefix_hashes.py), int64 bytes


def row_fact_tags(rows: Sequence[Sequence[int]], response_masks: Sequence[Sequence[int]],
                  hashes: bool = True) -> list[dict]:
    """``{LOSS_TOKENS_TAG, PREFIX_HASH_TAG}`` of each written row: ``rows`` each row's attended ids (prompt then
    response, as TransferQueue stores ``input_ids``), ``response_masks`` its response mask. One hash pass over all;
    ``hashes=False`` (a run without prefix trees): the loss tokens only."""
    if not hashes:
        return [{LOSS_TOKENS_TAG: int(np.count_nonzero(m))} for m in response_masks]
    parts = [np.asarray(r, dtype=np.int64) for r in rows]
    lengths = np.array([p.size for p in parts], dtype=np.int64)
    ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    hashes, offsets = prefix_block_hashes(TokenRows(ids, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)))
    return [{LOSS_TOKENS_TAG: int(np.count_nonzero(m)), PREFIX_HASH_TAG: hashes[a:b].tobytes()}
            for m, a, b in zip(response_masks, offsets[:-1].tolist(), offsets[1:].tolist())]


def tagged_loss_tokens(tags: Sequence[dict]) -> np.ndarray:
    """``[B]`` int64 each row's recorded loss tokens, ``-1`` where its tag has none (a row the agent loop did not
    write: read its ``response_mask``)."""
    return np.fromiter((t.get(LOSS_TOKENS_TAG, -1) for t in tags), dtype=np.int64, count=len(tags))


def tagged_hashes(tags: Sequence[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(hashes [H] int64, offsets [B + 1], recorded [B] bool)`` of the rows' recorded prefix hashes
    (:func:`~verl_traj.core.trees.prefix_hashes.prefix_block_hashes`' form); a row without has none and is not
    ``recorded``."""
    blobs = [t.get(PREFIX_HASH_TAG) for t in tags]
    recorded = np.array([b is not None for b in blobs], dtype=bool)
    counts = np.array([len(b) // 8 if b is not None else 0 for b in blobs], dtype=np.int64)
    hashes = np.frombuffer(b"".join(b for b in blobs if b is not None), dtype=np.int64)
    return hashes, np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), recorded


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
