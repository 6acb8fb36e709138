"""The plan's tree facts as both trainers ship them (``verl_traj.integration.trainers.tree_plan_facts``): built on the
planner's rows in their own order, then put in dispatch order, they equal the facts of the planned rows taken in
dispatch order (v0's dense ``[B, W]`` and v1's nested ``[B, L_r]`` alike), padding rows included."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.core.test_prefix_tree import PROPS, row_sets
from verl_traj.core.keys import TREE_INDEX, TREE_SIZE
from verl_traj.core.trees.tree_facts import micro_batch_tree_facts
from verl_traj.integration.trainers.tree_plan_facts import dense_tree_facts, nested_tree_facts


@PROPS
@given(rows=row_sets(), data=st.data())
def test_facts_from_the_source_rows_equal_the_facts_of_the_rows_in_dispatch_order(rows, data):
    pads = data.draw(st.integers(0, 3))
    order = np.asarray(data.draw(st.permutations(list(range(len(rows))) + [-1] * pads)), dtype=np.int64)
    b = order.size
    draw = lambda hi: torch.tensor(data.draw(st.lists(st.integers(0, hi), min_size=b, max_size=b)), dtype=torch.long)
    plan = SimpleNamespace(order=torch.from_numpy(order), rank=draw(1), mini_batch_id=draw(1), micro_batch_id=draw(2),
                           num_mini_batches=2)
    pad_rows = [[0] * data.draw(st.integers(1, 2)) for _ in range(pads)]
    it = iter(pad_rows)
    planned = [rows[o] if o >= 0 else next(it) for o in order.tolist()]
    part = ((plan.rank * 2 + plan.mini_batch_id) * 3 + plan.micro_batch_id).numpy()
    want = micro_batch_tree_facts(planned, part)
    dense = dense_tree_facts(rows, pad_rows, plan)
    nested = nested_tree_facts(rows, pad_rows, plan)
    assert dense[TREE_SIZE].tolist() == want.size.tolist() == nested[TREE_SIZE].tolist()
    for i in range(b):
        row = want.index[want.offsets[i]:want.offsets[i + 1]].tolist()
        assert dense[TREE_INDEX][i].tolist() == row + [-1] * (dense[TREE_INDEX].shape[1] - len(row))
        assert nested[TREE_INDEX][i].tolist() == row
