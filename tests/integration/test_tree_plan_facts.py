"""The plan's tree facts as both trainers ship them (``verl_traj.integration.trainers.tree_plan_facts``): built on the
planner's rows in their own order, then put in dispatch order, they equal the facts of the planned rows taken in
dispatch order (v0's dense ``[B, W]`` and v1's nested ``[B, L_r]`` alike), padding rows included."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.core.test_prefix_tree import PROPS, row_sets
from verl_traj.core.keys import TREE_SEGMENT, TREE_SIZE
from verl_traj.core.trees.tree_cost import TreeCostModel
from verl_traj.core.trees.tree_facts import TreeFacts, micro_batch_tree_facts
from verl_traj.integration.trainers.tree_plan_facts import row_tree_facts, tree_choice


@PROPS
@given(rows=row_sets(), data=st.data())
def test_facts_from_the_source_rows_equal_the_facts_of_the_rows_in_dispatch_order(rows, data):
    pads = data.draw(st.integers(0, 3))
    order = np.asarray(data.draw(st.permutations(list(range(len(rows))) + [-1] * pads)), dtype=np.int64)
    b = order.size
    draw = lambda hi: torch.tensor(data.draw(st.lists(st.integers(0, hi), min_size=b, max_size=b)), dtype=torch.long)
    plan = SimpleNamespace(order=torch.from_numpy(order), rank=draw(1), mini_batch_id=draw(1), micro_batch_id=draw(2),
                           num_mini_batches=2, spec=SimpleNamespace(micro_batch_max_tokens=None))
    pad_rows = [[0] * data.draw(st.integers(1, 2)) for _ in range(pads)]
    it = iter(pad_rows)
    planned = [rows[o] if o >= 0 else next(it) for o in order.tolist()]
    part = ((plan.rank * 2 + plan.mini_batch_id) * 3 + plan.micro_batch_id).numpy()
    want = micro_batch_tree_facts(planned, part)
    always = TreeCostModel(tree_token=0.5, margin=0.0)  # a tree costs at most half its rows: every micro-batch
    fields, trees = row_tree_facts(rows, pad_rows, plan, always)
    assert trees["actor/tree_share"] == 1.0 == trees["actor/tree_token_share"]
    assert fields[TREE_SIZE].tolist() == want.size.tolist()
    assert fields[TREE_SEGMENT].tolist() == want.segment.tolist()


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_each_micro_batch_runs_as_a_tree_only_where_the_cost_model_says_it_pays(data):
    """Issue 55, item 1: a micro-batch forwards as a tree where ``tree_token x N + micro_batch <= (1 - margin) x T``
    (``N`` its tree tokens, ``T`` its row tokens), else as rows (its rows' tree size 0), unless its rows exceed the
    cap; the metrics are the share of micro-batches and of row tokens that run as trees."""
    lengths = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=10))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    part = np.array(data.draw(st.lists(st.integers(0, 3), min_size=len(lengths), max_size=len(lengths))))
    shared = data.draw(st.lists(st.integers(0, 5), min_size=4, max_size=4))
    row_tokens = np.bincount(part, weights=lengths, minlength=4)
    size = np.array([max(1, int(row_tokens[p]) - shared[p]) for p in part], dtype=np.int64)
    facts = TreeFacts(np.zeros((len(lengths), 3), dtype=np.int64), offsets, size)
    cost = TreeCostModel(tree_token=data.draw(st.floats(0.3, 3.0)), micro_batch=data.draw(st.floats(0, 4)),
                         margin=data.draw(st.floats(0, 0.5)))
    cap = data.draw(st.none() | st.integers(1, 20))
    chosen, metrics = tree_choice(facts, np.arange(len(lengths)), part, cost, cap)
    want = {}
    for p in set(part.tolist()):
        n, t = size[part == p][0], row_tokens[p]
        want[p] = cost.tree_token * n + cost.micro_batch <= (1 - cost.margin) * t or (cap is not None and t > cap)
    assert chosen.size.tolist() == [size[i] if want[p] else 0 for i, p in enumerate(part.tolist())]
    assert metrics["actor/tree_share"] == pytest.approx(np.mean(list(want.values())))
    tree_rows = sum(row_tokens[p] for p, tree in want.items() if tree)
    assert metrics["actor/tree_token_share"] == pytest.approx(tree_rows / row_tokens.sum())


def test_the_break_even_sharing_of_each_device():
    """The published break-even: on this CPU a tree pays at any sharing; on the H100 figures a micro-batch must share
    59% of its row tokens (2.19 row tokens' time per tree token, 10% margin)."""
    from verl_traj.core.trees.tree_cost import tree_cost_model

    assert tree_cost_model("cpu").break_even_sharing(4096) == 0.0
    assert tree_cost_model("cuda").break_even_sharing(4096) == pytest.approx(1 - 0.9 / (5.9 / 2.7))
    assert tree_cost_model("cuda", tree_token_cost=1.0, margin=0.0).break_even_sharing(4096) == 0.0
