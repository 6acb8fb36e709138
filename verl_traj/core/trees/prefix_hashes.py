"""Rows' prefixes as block hashes, recorded where the rows are written, and the rows the tree planner reads from them
(issue 55, item 4): the v1 driver plans its prefix trees without fetching every row's ``input_ids`` every step.

Each row's attended tokens are cut into blocks of :data:`BLOCK` tokens. For each full block ``b`` the row records one
64-bit hash of its whole prefix through that block (``prefix_block_hashes``): 8 bytes per 16 tokens, a sixteenth of
the ids. From the hashes and the row lengths, :func:`hashed_rows` gives rows of stand-in ids that the trie
(:mod:`~verl_traj.core.trees.trie_layout`) reads as it reads token ids:

* a token of full block ``b`` gets the block's prefix hash (equal ids at a depth mean equal prefixes through that
  block);
* a token of the row's last, partial block gets an id of its own row (:data:`TAIL_BASE` + the row's index), so it is
  never shared.

So two rows share exactly the full blocks their prefixes agree on: a tree over these rows is a valid prefix tree of
the real rows, a little less shared than the exact one (at most ``BLOCK - 1`` tokens a row). A hash collision (two
different prefixes, one hash) would merge tokens that differ; the workers' tree check compares the real ids of every
tree token's rows (:func:`~verl_traj.core.trees.tree_facts.tree_from_facts`) and raises, so it cannot train silently.
Ids: hashes in ``[2^62, 2^63)``, tail ids in ``[2^61, 2^62)``, real token ids (padding rows keep theirs) below.

Pure module (numpy).
"""

from __future__ import annotations

import numpy as np

from verl_traj.core.trees.token_rows import TokenRows

__all__ = ["BLOCK", "TAIL_BASE", "hashed_rows", "prefix_block_hashes"]

BLOCK = 16  # tokens a hash covers
TAIL_BASE = 1 << 61  # a row's partial last block: TAIL_BASE + its row index
_HASH_BIT = np.uint64(1 << 62)
_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))
_POWERS = np.array([0x9E3779B97F4A7C15 * (2 * i + 1) % (1 << 64) for i in range(BLOCK)], dtype=np.uint64)


def _splitmix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on ``uint64`` (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX[0]
    z = (z ^ (z >> np.uint64(27))) * _MIX[1]
    return z ^ (z >> np.uint64(31))


def prefix_block_hashes(rows: TokenRows) -> tuple[np.ndarray, np.ndarray]:
    """``(hashes [H] int64, offsets [R + 1] int64)``: row ``r``'s prefix hashes are ``hashes[offsets[r]:offsets[r +
    1]]``, one per full block (``lengths // BLOCK``), each a function of the row's ids through that block only (the
    same prefix gives the same hash in any row, batch or process). Array work over the batch, no loop over rows."""
    lengths = rows.lengths
    full = lengths // BLOCK
    offsets = np.concatenate([[0], np.cumsum(full)]).astype(np.int64)
    if not offsets[-1]:
        return np.zeros(0, dtype=np.int64), offsets
    pos = np.arange(rows.ids.size, dtype=np.int64) - np.repeat(rows.offsets[:-1], lengths)
    keep = pos < np.repeat(full * BLOCK, lengths)  # tokens of full blocks: BLOCK-aligned runs, in row order
    tokens = _splitmix((rows.ids[keep].astype(np.uint64) + np.uint64(1)) * _POWERS[pos[keep] % BLOCK])
    block = tokens.reshape(-1, BLOCK).sum(axis=1, dtype=np.uint64)  # wraps mod 2^64
    depth = np.arange(block.size, dtype=np.int64) - np.repeat(offsets[:-1], full)
    values = _splitmix(block ^ _splitmix(depth.astype(np.uint64) + np.uint64(0x632BE59BD9B4E019)))
    total = np.cumsum(values, dtype=np.uint64)
    before = np.concatenate([np.zeros(1, np.uint64), total])[np.repeat(offsets[:-1], full)]
    prefix = _splitmix(total - before)  # the sum over the row's blocks so far, mixed
    return ((prefix >> np.uint64(2)) | _HASH_BIT).astype(np.int64), offsets


def hashed_rows(hashes: np.ndarray, hash_offsets: np.ndarray, lengths: np.ndarray) -> TokenRows:
    """The stand-in rows (module docstring) of ``R`` rows of ``lengths`` ``[R]`` tokens whose prefix hashes are
    ``hashes`` / ``hash_offsets`` (:func:`prefix_block_hashes`' form; each row ``lengths[r] // BLOCK`` of them)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    full = np.diff(hash_offsets)
    if full.shape != lengths.shape or (full != lengths // BLOCK).any():
        bad = int(np.flatnonzero(full != lengths // BLOCK)[0]) if full.shape == lengths.shape else -1
        raise ValueError(f"row {bad}: {full[bad] if bad >= 0 else full.size} prefix hashes for a row of "
                         f"{lengths[bad] if bad >= 0 else lengths.size} tokens (want one per {BLOCK} tokens): the row "
                         "was changed after its hashes were recorded")
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    row = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)
    block = np.arange(offsets[-1], dtype=np.int64) - offsets[:-1][row]
    block //= BLOCK
    in_full = block < full[row]
    at = np.where(in_full, hash_offsets[:-1][row] + block, 0)
    padded = np.concatenate([hashes.astype(np.int64), np.zeros(1, np.int64)])
    return TokenRows(np.where(in_full, padded[at], TAIL_BASE + row), offsets)
