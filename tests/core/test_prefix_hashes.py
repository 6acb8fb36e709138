"""Prefix trees from block hashes recorded at row write (issue 55, item 4; ``verl_traj.core.trees.prefix_hashes``).

Properties over random rows that share prompts and branch anywhere: a block's hash depends on the prefix through it
only (equal prefixes, equal hashes, in any row; different ones differ); the tree facts built from the stand-in rows
are a valid prefix tree of the real rows (the device tree from them has no mismatch, every row token attends exactly
its row's earlier tokens, the rows come back), shared at most ``BLOCK - 1`` tokens a row less than the exact tree; a
hash collision is caught by the workers' check, never trained."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.core.test_prefix_tree import PROPS
from tests.core.test_tree_facts import _inputs
from verl_traj.core.trees.prefix_hashes import BLOCK, TAIL_BASE, hashed_rows, prefix_block_hashes
from verl_traj.core.trees.prefix_tree import tree_token_count
from verl_traj.core.trees.token_rows import token_rows
from verl_traj.core.trees.tree_facts import micro_batch_tree_facts, tree_from_facts


@st.composite
def long_rows(draw) -> list[list[int]]:
    """1-3 prompts of 0-70 tokens, each with 1-4 continuations of 0-40, plus copies and prefixes of them: branch
    points fall inside and on block boundaries; ids from a small vocabulary (repeats) or a large one."""
    high = draw(st.sampled_from([3, 151_000]))
    tok = st.integers(0, high)
    rows = []
    for prompt in draw(st.lists(st.lists(tok, max_size=70), min_size=1, max_size=3)):
        rows += [prompt + c for c in draw(st.lists(st.lists(tok, max_size=40), min_size=1, max_size=4))]
    for a, cut in draw(st.lists(st.tuples(st.integers(0, 99), st.integers(0, 200)), max_size=3)):
        src = rows[a % len(rows)]
        rows.append(src[:cut % (len(src) + 1)])
    return rows


def _hashes(rows):
    hashes, offsets = prefix_block_hashes(token_rows(rows))
    return [hashes[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


@PROPS
@given(rows=long_rows())
def test_a_blocks_hash_is_its_prefixs_alone(rows):
    per_row = _hashes(rows)
    for r, h in zip(rows, per_row):
        assert len(h) == len(r) // BLOCK and (h >= 1 << 62).all()
    seen = {}
    for r, h in zip(rows, per_row):
        for b, value in enumerate(h.tolist()):
            prefix = tuple(r[:(b + 1) * BLOCK])
            assert seen.setdefault(prefix, value) == value  # the same prefix, the same hash, in any row
    assert len(set(seen.values())) == len(seen)  # different prefixes, different hashes
    alone = [_hashes([r])[0] for r in rows]  # and in any batch
    assert all(np.array_equal(a, h) for a, h in zip(alone, per_row))


def _attended(tree, row_slots: list[int]) -> list[set]:
    """Each row token's attended tree slots: ``k`` with ``k <= q <= subtree_end[k]``."""
    end = tree.subtree_end.tolist()
    return [{k for k in range(q + 1) if end[k] >= q} for q in row_slots]


@PROPS
@given(rows=long_rows(), data=st.data())
def test_the_tree_from_hashes_is_a_valid_prefix_tree_of_the_real_rows(rows, data):
    hashes, offsets = prefix_block_hashes(token_rows(rows))
    stand_in = hashed_rows(hashes, offsets, [len(r) for r in rows])
    part = np.asarray(data.draw(st.lists(st.integers(0, 1), min_size=len(rows), max_size=len(rows))))
    facts = micro_batch_tree_facts(stand_in, part)
    for key in np.unique(part).tolist():
        members = np.flatnonzero(part == key).tolist()
        if not sum(len(rows[i]) for i in members):
            continue
        tree = tree_from_facts(*_inputs(rows, facts, members))
        assert {k: int(v) for k, v in tree.checks.items()} == {"tree_index": 0, "position_ids": 0}
        for r, (a, b) in zip(members, zip(tree.row_offsets[:-1].tolist(), tree.row_offsets[1:].tolist())):
            slots = tree.row_index[a:b].tolist()
            assert tree.input_ids[slots].tolist() == rows[r]  # the row comes back
            assert _attended(tree, slots) == [set(slots[:j + 1]) for j in range(len(slots))]
        exact = tree_token_count([rows[i] for i in members])[0]
        size = int(facts.size[members[0]])
        assert exact <= size <= min(sum(len(rows[i]) for i in members), exact + BLOCK * len(members))


def test_a_group_behind_one_long_prompt_shares_its_full_blocks():
    """8 responses behind a 1,000-token prompt: the prompt's 62 full blocks once (and a copy of its last token for
    each further branch, as in the exact tree), each row its own last 8 prompt tokens and response."""
    prompt = list(range(1000))
    rows = [prompt + [5000 + i] * 100 for i in range(8)]
    hashes, offsets = prefix_block_hashes(token_rows(rows))
    facts = micro_batch_tree_facts(hashed_rows(hashes, offsets, [1100] * 8), np.zeros(8, dtype=np.int64))
    assert int(facts.size[0]) == 62 * BLOCK + 7 + 8 * (1100 - 62 * BLOCK)
    assert tree_token_count(rows)[0] == 1000 + 8 * 100 + 7  # the exact tree (7 branch copies)


def test_a_collision_is_caught_by_the_workers_check():
    """Two different rows given one hash (a forced collision) share tree tokens whose real ids differ: the device
    tree counts the mismatch, which the pass raises on."""
    rows = [[1] * BLOCK + [2], [3] * BLOCK + [4]]
    hashes, offsets = prefix_block_hashes(token_rows(rows))
    hashes[1] = hashes[0]
    facts = micro_batch_tree_facts(hashed_rows(hashes, offsets, [17, 17]), np.zeros(2, dtype=np.int64))
    assert int(tree_from_facts(*_inputs(rows, facts, [0, 1])).checks["tree_index"]) > 0


def test_hashes_that_do_not_fit_the_row_are_refused():
    hashes, offsets = prefix_block_hashes(token_rows([[1] * 40]))
    with pytest.raises(ValueError, match="changed after its hashes were recorded"):
        hashed_rows(hashes, offsets, [50])
    assert hashed_rows(hashes, offsets, [40]).ids[-1] == TAIL_BASE  # row 0's tail
    assert torch.is_tensor(torch.from_numpy(hashed_rows(hashes, offsets, [40]).ids))
