"""Every micro-batch's tree at once (``verl_traj.core.trees.trie_layout``, issue 40 item 2) against a reference built one
tree at a time, row by row, the obvious way; and the rows it takes (``verl_traj.core.trees.token_rows``).

Invariants: for random row sets cut into random parts, each row token's tree index and each part's tree size equal
the reference's (rows sorted as Python sorts id lists, each row's segment start from its common prefix with the
previous one, each row's path the previous row's path up to its start, then its own segment); common prefixes longer
than the first comparison blocks, identical rows and deep chains (every row a prefix of the next) included; the
previous-smaller search equals brute force.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.core.test_prefix_tree import PROPS, row_sets
from verl_traj.core.errors import TrajInputError
from verl_traj.core.trees.token_rows import TokenRows, token_rows
from verl_traj.core.trees.trie_layout import _common_prefix, _prev_smaller, row_index, trie_layout


def _reference_tree(rows: list[list[int]]) -> tuple[list[list[int]], int]:
    """(each row's path, tree tokens) of one tree, one row at a time."""
    order = sorted((r for r in range(len(rows)) if rows[r]), key=lambda r: rows[r])
    paths: dict[int, list[int]] = {}
    path: list[int] = []
    prev, used = None, 0
    for r in order:
        row = rows[r]
        if prev is not None and row == rows[prev]:
            paths[r] = paths[prev]
            continue
        start = 0
        if prev is not None:
            before = rows[prev]
            lcp = next((j for j in range(min(len(row), len(before))) if row[j] != before[j]), min(len(row), len(before)))
            start = lcp if lcp in (0, len(before)) else lcp - 1
        path = path[:start] + list(range(used, used + len(row) - start))
        used += len(row) - start
        paths[r] = path
        prev = r
    return [paths.get(r, []) for r in range(len(rows))], used


def _check_against_reference(rows: list[list[int]], part: np.ndarray) -> None:
    flat = token_rows(rows)
    layout = trie_layout(flat, part)
    index = row_index(flat, layout)
    for key in np.unique(part).tolist():
        members = np.flatnonzero(part == key).tolist()
        paths, size = _reference_tree([rows[i] for i in members])
        for i, path in zip(members, paths):
            assert index[flat.offsets[i]:flat.offsets[i + 1]].tolist() == path
            assert layout.part_size[layout.part_of_row[i]] == size


@PROPS
@given(rows=row_sets(), data=st.data())
def test_every_parts_tree_is_the_one_tree_at_a_time_reference(rows, data):
    part = np.asarray(data.draw(st.lists(st.integers(-2, 3), min_size=len(rows), max_size=len(rows))), dtype=np.int64)
    _check_against_reference(rows, part)


def test_long_common_prefixes_identical_rows_and_deep_chains():
    """Common prefixes past several doubling blocks (32, 64, ...), at a block edge, whole rows equal; 300 step rows of
    one trajectory, each a prefix of the next (a 300-link chain), and their branches."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 50_000, 5_000).tolist()
    rows = [prompt + [1], prompt + [2], prompt[:32] + [7], prompt[:33] + [7], prompt[:4_000], prompt, prompt, []]
    _check_against_reference(rows, np.zeros(len(rows), dtype=np.int64))
    steps = [prompt[:10 * (k + 1)] for k in range(300)] + [prompt[:10 * k + 5] + [9] for k in range(1, 300, 7)]
    order = rng.permutation(len(steps))
    _check_against_reference([steps[i] for i in order], rng.integers(0, 2, len(steps)))


@given(st.lists(st.integers(0, 6), max_size=60))
def test_previous_smaller_is_brute_force(values):
    values = np.asarray(values, dtype=np.int64)
    want = [max((k for k in range(i) if values[k] < values[i]), default=-1) for i in range(values.size)]
    assert _prev_smaller(values).tolist() == want


@given(st.lists(st.tuples(st.lists(st.integers(0, 2), max_size=300), st.lists(st.integers(0, 2), max_size=300))))
def test_common_prefix_is_brute_force(pairs):
    rows = token_rows([r for pair in pairs for r in pair])
    a, b = rows.offsets[0:-1:2], rows.offsets[1:-1:2]
    m = np.minimum(rows.lengths[0::2], rows.lengths[1::2])
    want = [next((j for j in range(min(len(x), len(y))) if x[j] != y[j]), min(len(x), len(y))) for x, y in pairs]
    assert _common_prefix(rows.ids, a, b, m).tolist() == want


def test_token_rows_from_a_padded_batch_and_in_plan_order():
    ids = torch.tensor([[0, 5, 6, 0], [7, 8, 9, 1], [0, 0, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    rows = TokenRows.of_padded(ids, mask)
    assert [r.tolist() for r in rows.as_list()] == [[5, 6], [7, 8, 9, 1], []]
    assert [r.tolist() for r in rows.take([1, 1, 2, 0]).as_list()] == [[7, 8, 9, 1], [7, 8, 9, 1], [], [5, 6]]
    assert token_rows(rows) is rows


def test_bad_rows_and_parts_are_refused_naming_the_field():
    with pytest.raises(TrajInputError) as err:
        TokenRows(np.array([1, 2, -100, 3]), np.array([0, 2, 4]))
    assert err.value.field == "rows[1][0]" and "-100" in str(err.value)
    with pytest.raises(TrajInputError) as err:
        TokenRows(np.array([1, 2]), np.array([0, 3]))
    assert err.value.field == "rows.offsets"
    with pytest.raises(TrajInputError) as err:
        trie_layout(token_rows([[1], [2]]), np.array([0.5, 1.0]))
    assert err.value.field == "part"
