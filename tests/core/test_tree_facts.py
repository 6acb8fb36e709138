"""Trees planned on the driver, built on the device (``verl_traj.core.trees.tree_facts``, issue 40): property tests over the
random row sets of ``test_prefix_tree`` cut into random micro-batches.

Invariants: the tree a worker builds from the shipped facts and its rows is the builder's tree of those rows
(tokens, depths, subtree ends, row -> tree map), in packed and in per-row ``[R, W]`` form, whatever the rows' order
within the micro-batch; its checks are all 0 and its statistics are the builder's; the construction has no host read
and no data-dependent shape (it runs on the ``meta`` device, where any read of a value raises); facts that do not
reproduce the rows (a token pointed at another tree token, rows moved to another micro-batch) are counted.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.core.test_prefix_tree import PROPS, row_sets
from verl_traj.core.errors import TrajInputError
from verl_traj.core.trees.prefix_tree import attention_pairs, build_prefix_tree, row_attention_pairs
from verl_traj.core.keys import TREE_SEGMENT
from verl_traj.core.trees.tree_facts import micro_batch_tree_facts, plan_sources, segment_tree_index, tree_from_facts


def _inputs(rows: list, facts, members: list, device: str = "cpu"):
    """What a worker holds for the micro-batch of ``members``: packed ids, position ids, row offsets, the rows'
    tree indices as the worker computes them from the rows' segments (:func:`segment_tree_index`) and ``N``."""
    lengths = [len(rows[i]) for i in members]
    ids = torch.tensor([t for i in members for t in rows[i]], dtype=torch.int64)
    pos = torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0, dtype=torch.int64)
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64)
    index = segment_tree_index(offsets.to(device), torch.from_numpy(facts.segment[members]).to(device), int(sum(lengths)))
    size = int(facts.size[members[0]])
    return tuple(t.to(device) for t in (ids, pos, offsets)) + (index, size)


@PROPS
@given(rows=row_sets(), data=st.data())
def test_the_device_tree_from_the_facts_is_the_builders_tree(rows, data):
    part = np.asarray(data.draw(st.lists(st.integers(0, 2), min_size=len(rows), max_size=len(rows))))
    facts = micro_batch_tree_facts(rows, part)
    for key in np.unique(part).tolist():
        members = np.flatnonzero(part == key).tolist()
        if not sum(len(rows[i]) for i in members):
            assert facts.size[members].tolist() == [0] * len(members)
            continue
        ref = build_prefix_tree([torch.tensor(rows[i], dtype=torch.int64) for i in members])
        order = data.draw(st.permutations(members))  # the worker may hold the micro-batch's rows in any order
        tree = tree_from_facts(*_inputs(rows, facts, order))
        for name in ("input_ids", "position_ids", "subtree_end"):
            assert torch.equal(getattr(tree, name), getattr(ref, name)), name
        assert {k: int(v) for k, v in tree.checks.items()} == {"tree_index": 0, "position_ids": 0}
        assert int(tree.stats["branch_copies"]) == ref.num_branch_copies
        assert int(tree.stats["attention_pairs"]) == attention_pairs(ref)
        assert int(tree.stats["row_attention_pairs"]) == row_attention_pairs(ref)
        ref_rows = {i: ref.row_index[a:b].tolist() for i, a, b in zip(members, ref.row_offsets[:-1].tolist(),
                                                                     ref.row_offsets[1:].tolist())}
        assert facts.index_of(order).tolist() == [t for i in order for t in ref_rows[i]]  # the builder's row_index
        back = [tree.input_ids[tree.row_index[a:b]].tolist() for a, b in zip(tree.row_offsets[:-1].tolist(),
                                                                          tree.row_offsets[1:].tolist())]
        assert back == [rows[i] for i in order]
        meta = tree_from_facts(*_inputs(rows, facts, order, device="meta"))  # no value is ever read
        assert meta.subtree_end.shape == ref.subtree_end.shape and meta.row_index.shape == ref.row_index.shape


@PROPS
@given(rows=row_sets(), data=st.data())
def test_facts_that_do_not_reproduce_the_rows_are_counted(rows, data):
    facts = micro_batch_tree_facts(rows, np.zeros(len(rows), dtype=np.int64))
    members = [i for i in range(len(rows)) if rows[i]]
    if not members:
        return
    ids, pos, offsets, index, size = _inputs(rows, facts, members)
    tree = build_prefix_tree([torch.tensor(rows[i], dtype=torch.int64) for i in members])
    t = data.draw(st.integers(0, index.numel() - 1))
    wrong = [k for k in range(size) if (tree.input_ids[k], tree.position_ids[k]) != (ids[t], pos[t])]
    target = data.draw(st.sampled_from(wrong + [size, -1]))  # another token's instance, or out of range
    moved = index.clone()
    moved[t] = target
    assert int(tree_from_facts(ids, pos, offsets, moved, size).checks["tree_index"]) > 0
    shifted = pos.clone()
    shifted[t] += 1
    assert int(tree_from_facts(ids, shifted, offsets, index, size).checks["position_ids"]) == 1


def test_rows_moved_to_another_micro_batch_are_counted():
    """Two micro-batches planned; the worker holds one of them with a row of the other: its facts index the other
    tree, so the row's tokens are not this tree's."""
    rows = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6], [7, 8, 9, 1], [7, 8, 2]]
    facts = micro_batch_tree_facts(rows, [0, 0, 0, 1, 1])
    ids, pos, offsets, index, size = _inputs(rows, facts, [0, 1, 3])
    assert int(tree_from_facts(ids, pos, offsets, index, size).checks["tree_index"]) > 0
    assert int(tree_from_facts(*_inputs(rows, facts, [0, 1, 2])).checks["tree_index"]) == 0


def test_bad_facts_input_is_refused_naming_the_field():
    with pytest.raises(TrajInputError) as raised:
        micro_batch_tree_facts([[1, 2], [3]], [0])
    assert raised.value.field == "part"
    with pytest.raises(TrajInputError) as raised:
        micro_batch_tree_facts([[1, 2], [-3]], [0, 0])
    assert raised.value.field == "rows[1][0]"
    with pytest.raises(TrajInputError) as raised:
        tree_from_facts(torch.tensor([1]), torch.tensor([0]), torch.tensor([0, 1]), torch.tensor([0]), 0)
    assert raised.value.field == "num_tree_tokens"


@pytest.mark.parametrize("index", [torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2, 3, 4, 5]),
                                   torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.zeros(1, 2, 3, dtype=torch.long)])
def test_an_index_of_another_batchs_length_is_refused_before_any_indexing(index):
    """Two rows of 2 and 3 tokens: an index of 3 or 6 tokens, of 3 rows, or 3-D (a batch cut or reordered after
    planning) raises naming the field, instead of an out-of-range scatter (a device-side assert on CUDA)."""
    ids = torch.tensor([5, 6, 5, 6, 7])
    with pytest.raises(TrajInputError) as raised:
        tree_from_facts(ids, torch.tensor([0, 1, 0, 1, 2]), torch.tensor([0, 2, 5]), index, 3)
    assert raised.value.field == TREE_SEGMENT and "planned batch unmodified" in str(raised.value)


@pytest.mark.parametrize("segment", [torch.zeros(3, 3, dtype=torch.long), torch.zeros(2, 2, dtype=torch.long),
                                     torch.zeros(2, dtype=torch.long)])
def test_segments_of_another_batchs_rows_are_refused_naming_the_field(segment):
    """Segments for 3 rows, of 2 ints, or 1-D, for a micro-batch of 2 rows: refused before any indexing."""
    with pytest.raises(TrajInputError) as raised:
        segment_tree_index(torch.tensor([0, 2, 5]), segment, 5)
    assert raised.value.field == TREE_SEGMENT and "planned batch unmodified" in str(raised.value)


def test_segments_are_three_ints_a_row_whatever_the_rows_lengths():
    """The facts the plan ships do not grow with the tokens: 8 rows of 4,000 tokens sharing a 3,000-token prefix,
    24 ints; the worker's index from them is the builder's."""
    rows = [[1] * 3000 + [2 + i] * 1000 for i in range(8)]
    facts = micro_batch_tree_facts(rows, np.zeros(8, dtype=np.int64))
    assert facts.segment.shape == (8, 3) and int(facts.size[0]) == 3000 + 8 * 1000 + 7  # 7 branch copies
    ref = build_prefix_tree([torch.tensor(r) for r in rows])
    assert facts.index_of(range(8)).tolist() == ref.row_index.tolist()


def test_plan_sources_reads_only_the_padding_rows_again():
    """Both trainers build the planned trees from the planner's own rows by ``plan.order``; the padding slots take the
    rows read back, in order, after them; a count that does not match is refused, naming the field."""
    rows = [np.array([1, 2]), np.array([3]), np.array([4, 5, 6])]
    pads = [np.array([0]), np.array([0, 0])]
    sources, source = plan_sources(rows, np.array([2, -1, 0, 1, -1]), pads)
    assert [r.tolist() for r in sources.as_list()] == [[1, 2], [3], [4, 5, 6], [0], [0, 0]]
    assert source.tolist() == [2, 3, 0, 1, 4]
    with pytest.raises(TrajInputError) as err:
        plan_sources(rows, np.array([2, -1, 0]), pads)
    assert err.value.field == "pad_rows"
