"""The prefix tree of a micro-batch's rows (issue 29, item 1): property tests over random row sets that share
prefixes (a few prompts with several continuations; duplicates, prefixes of other rows, empty rows, branches inside
prompts and responses, small and large ids), then worked examples and the refused inputs.

Invariants: every row recovered exactly (ids and positions); tree tokens = distinct non-empty prefixes + branch
copies; labels = each row's own next tokens; each row token attends exactly the tree tokens of that row's earlier
tokens; so a dense reference attention over the tree gathered back to rows equals per-row causal attention (fp64,
outputs, next-token log-probs and gradients); padding rows change nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl_traj.core.errors import TrajInputError
from verl_traj.core.trees.prefix_tree import (
    IGNORE_INDEX,
    attention_pairs,
    build_prefix_tree,
    gather_flat,
    gather_padded,
    gather_rows,
    row_attention_pairs,
    tree_attention_mask,
    tree_token_count,
)

PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def row_sets(draw) -> list[list[int]]:
    """1-3 prompts with 1-4 continuations each over a small vocabulary (so branches fall anywhere), then a few
    duplicates / truncations / empty rows / one-token edits, shuffled; ids scaled to exercise multi-byte ids."""
    tok = st.integers(0, draw(st.integers(1, 5)))
    rows: list[list[int]] = []
    for prompt in draw(st.lists(st.lists(tok, max_size=8), min_size=1, max_size=3)):
        rows += [prompt + cont for cont in draw(st.lists(st.lists(tok, max_size=6), min_size=1, max_size=4))]
    extras = st.tuples(st.sampled_from(["dup", "prefix", "empty", "edit"]), st.integers(0, 99), st.integers(0, 99), tok)
    for kind, a, b, t in draw(st.lists(extras, max_size=5)):
        src = rows[a % len(rows)]
        cut = b % (len(src) + 1)
        rows.append({"dup": src, "prefix": src[:cut], "empty": [], "edit": src[:cut] + [t] + src[cut + 1:]}[kind])
    scale, shift = draw(st.sampled_from([(1, 0), (257, 3), (2**31 + 11, 151_000)]))
    return [[x * scale + shift for x in rows[i]] for i in draw(st.permutations(range(len(rows))))]


def _tensors(rows: list[list[int]]) -> list[torch.Tensor]:
    return [torch.tensor(r, dtype=torch.int64) for r in rows]


def _row_paths(tree) -> list[list[int]]:
    o = tree.row_offsets.tolist()
    return [tree.row_index[o[r]:o[r + 1]].tolist() for r in range(tree.num_rows)]


def _reference_trie(rows: list[list[int]]) -> tuple[int, int]:
    """(distinct non-empty prefixes, sum over trie nodes of max(0, children - 1)) with a dict trie."""
    children: dict[tuple, set] = {}
    for row in rows:
        for j in range(len(row)):
            children.setdefault(tuple(row[:j + 1]), set())
            if j + 1 < len(row):
                children[tuple(row[:j + 1])].add(row[j + 1])
    return len(children), sum(max(0, len(c) - 1) for c in children.values())


# ---------------------------------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------------------------------


@PROPS
@given(row_sets())
def test_rows_recovered_and_token_counts(rows):
    tree = build_prefix_tree(_tensors(rows))
    assert tree.num_rows == len(rows) and tree.num_row_tokens == sum(map(len, rows))
    for row, path in zip(rows, _row_paths(tree)):
        assert tree.input_ids[path].tolist() == row
        assert tree.position_ids[path].tolist() == list(range(len(row)))
    distinct, copies = _reference_trie(rows)
    assert tree.num_tree_tokens - tree.num_branch_copies == distinct
    assert tree.num_branch_copies == copies
    assert tree_token_count(rows) == (tree.num_tree_tokens, tree.num_branch_copies)
    assert sorted(set(tree.row_index.tolist())) == list(range(tree.num_tree_tokens))  # every tree token is used
    assert tree.num_tree_tokens <= tree.num_row_tokens and attention_pairs(tree) <= row_attention_pairs(tree)
    assert attention_pairs(tree) == int((tree.position_ids + 1).sum())
    assert row_attention_pairs(tree) == sum(len(r) * (len(r) + 1) // 2 for r in rows)
    for t in (tree.input_ids, tree.position_ids, tree.labels, tree.subtree_end, tree.row_index, tree.row_offsets):
        assert t.dtype == torch.int64 and t.dim() == 1


@PROPS
@given(row_sets())
def test_labels_are_each_rows_next_tokens(rows):
    tree = build_prefix_tree(_tensors(rows))
    for row, path in zip(rows, _row_paths(tree)):
        assert tree.labels[path[:-1]].tolist() == row[1:]
    ids, pos, labels, end = tree.input_ids, tree.position_ids, tree.labels, tree.subtree_end
    if tree.num_tree_tokens:  # verl's rolled labels: the next serialised token is the label child, else a leaf
        child = pos[1:] == pos[:-1] + 1
        assert torch.equal(labels[:-1], torch.where(child, ids[1:], torch.full_like(ids[1:], IGNORE_INDEX)))
        assert int(labels[-1]) == IGNORE_INDEX
        assert torch.equal(labels != IGNORE_INDEX, end > torch.arange(tree.num_tree_tokens))


@PROPS
@given(row_sets())
def test_each_row_token_attends_exactly_its_rows_earlier_tokens(rows):
    tree = build_prefix_tree(_tensors(rows))
    n = tree.num_tree_tokens
    k = torch.arange(n)
    assert bool((tree.subtree_end >= k).all()) and bool((tree.subtree_end < max(n, 1)).all())
    mask = tree_attention_mask(tree)
    for path in _row_paths(tree):
        for j, q in enumerate(path):
            assert torch.nonzero(mask[q]).reshape(-1).tolist() == sorted(path[:j + 1])
    depth = mask.sum(-1) - 1  # ancestors of a token = its depth
    assert torch.equal(depth, tree.position_ids)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(row_sets(), st.integers(0, 2**31 - 1))
def test_tree_attention_equals_per_row_attention(rows, seed):
    """Two fp64 attention layers on an embedding of (id, position): tree outputs gathered to rows, next-token
    log-probs at tree.labels, and the gradient of a per-row weighted loss all equal the per-row computation."""
    g = torch.Generator().manual_seed(seed)
    vocab = sorted({x for r in rows for x in r}) or [0]
    cls = {x: i for i, x in enumerate(vocab)}
    dim = 8
    weights = [torch.randn(dim, dim, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(7)]
    freq = torch.randn(2, dim, generator=g, dtype=torch.float64)
    out_w = torch.randn(dim, len(vocab), generator=g, dtype=torch.float64)

    def forward(ids, pos, mask):
        h = torch.sin(torch.tensor([cls[i] for i in ids.tolist()], dtype=torch.float64)[:, None] * freq[0]
                      + pos.double()[:, None] * freq[1])
        for wq, wk, wv in (weights[0:3], weights[3:6]):
            s = (h @ wq) @ (h @ wk).T / dim ** 0.5
            h = h + torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ (h @ wv)
        return h @ weights[6], torch.log_softmax(h @ weights[6] @ out_w, -1)

    tree = build_prefix_tree(_tensors(rows))
    t_h, t_logp = forward(tree.input_ids, tree.position_ids, tree_attention_mask(tree))
    labels = torch.tensor([cls.get(x, 0) for x in tree.labels.tolist()])
    t_lp = t_logp.gather(-1, labels[:, None]).squeeze(-1)
    row_w = torch.rand(len(rows), generator=g, dtype=torch.float64)
    loss_t, loss_r = 0.0, 0.0
    for r, (row, h_g, lp_g) in enumerate(zip(rows, gather_rows(tree, t_h), gather_rows(tree, t_lp))):
        if not row:
            assert h_g.shape == (0, dim)
            continue
        ids = torch.tensor(row)
        r_h, r_logp = forward(ids, torch.arange(len(row)), torch.ones(len(row), len(row), dtype=torch.bool).tril())
        r_lp = r_logp[:-1].gather(-1, torch.tensor([cls[x] for x in row[1:]])[:, None]).squeeze(-1)
        torch.testing.assert_close(h_g, r_h, rtol=0, atol=1e-12)
        torch.testing.assert_close(lp_g[:-1], r_lp, rtol=0, atol=1e-12)
        loss_t = loss_t + row_w[r] * (h_g.sum() + lp_g[:-1].sum())
        loss_r = loss_r + row_w[r] * (r_h.sum() + r_lp.sum())
    if isinstance(loss_t, torch.Tensor):
        grads_t = torch.autograd.grad(loss_t, weights)
        grads_r = torch.autograd.grad(loss_r, weights)
        for a, b in zip(grads_t, grads_r):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@PROPS
@given(row_sets(), st.lists(st.integers(0, 99), max_size=4), st.randoms(use_true_random=False))
def test_padding_rows_and_row_order_change_nothing(rows, pad_at, rnd):
    tree = build_prefix_tree(_tensors(rows))
    padded = [list(r) for r in rows]
    for p in pad_at:
        padded.insert(p % (len(padded) + 1), [])
    order = list(range(len(padded)))
    rnd.shuffle(order)
    other = build_prefix_tree([torch.tensor(padded[i], dtype=torch.int64) for i in order])
    for name in ("input_ids", "position_ids", "labels", "subtree_end"):
        assert torch.equal(getattr(tree, name), getattr(other, name)), name
    assert other.num_branch_copies == tree.num_branch_copies
    path_of = {tuple(row): path for row, path in zip(rows, _row_paths(tree))}  # a row's path depends on its ids only
    for k, path in enumerate(_row_paths(other)):
        assert path == path_of.get(tuple(padded[order[k]]), [])
    assert tree_token_count(padded) == tree_token_count(rows)


@PROPS
@given(st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=6), max_size=6))
def test_rows_sharing_nothing_and_identical_rows(tails):
    rows = [[1000 + i] + t for i, t in enumerate(tails)]  # distinct first tokens: nothing shared
    tree = build_prefix_tree(_tensors(rows))
    assert tree.num_tree_tokens == sum(map(len, rows)) and tree.num_branch_copies == 0
    twice = build_prefix_tree(_tensors(rows + rows[::-1]))  # identical rows cost nothing
    assert torch.equal(twice.input_ids, tree.input_ids) and twice.num_branch_copies == 0
    assert tree_token_count(rows + rows) == (sum(map(len, rows)), 0)


# ---------------------------------------------------------------------------------------------------------------------
# Worked examples
# ---------------------------------------------------------------------------------------------------------------------


def test_worked_example_with_a_branch_copy():
    rows = [[1, 2, 3], [1, 2, 4], [1, 2, 4, 5], [], [1, 2], [7, 8], [1, 2, 3]]
    tree = build_prefix_tree(_tensors(rows))
    assert tree.input_ids.tolist() == [1, 2, 3, 2, 4, 5, 7, 8]  # the second 2 is a copy: [1, 2 | 4 ...] branches off
    assert tree.position_ids.tolist() == [0, 1, 2, 1, 2, 3, 0, 1]
    assert tree.labels.tolist() == [2, 3, -100, 4, 5, -100, 8, -100]
    assert tree.subtree_end.tolist() == [5, 2, 2, 5, 5, 5, 7, 7]
    assert _row_paths(tree) == [[0, 1, 2], [0, 3, 4], [0, 3, 4, 5], [], [0, 1], [6, 7], [0, 1, 2]]
    assert tree.num_branch_copies == 1 and tree.num_row_tokens == 17 and tree.num_tree_tokens == 8
    assert (attention_pairs(tree), row_attention_pairs(tree)) == (18, 34)
    assert gather_padded(tree, tree.input_ids, pad_value=-1).tolist()[2:4] == [[1, 2, 4, 5], [-1, -1, -1, -1]]
    assert gather_flat(tree, tree.position_ids).tolist()[:6] == [0, 1, 2, 0, 1, 2]


def test_branch_at_the_first_token_and_deep_rows():
    tree = build_prefix_tree(_tensors([[5, 1], [5, 2], [5, 3]]))
    assert tree.input_ids.tolist() == [5, 1, 5, 2, 5, 3] and tree.num_branch_copies == 2
    assert tree.subtree_end.tolist() == [1, 1, 3, 3, 5, 5]
    long = torch.arange(5000) % 7  # no recursion: a 5000-token row and a branch near its end
    tree = build_prefix_tree([long, torch.cat([long[:4990], torch.tensor([9])])])
    assert tree.num_tree_tokens == 5000 + 2 and tree.num_branch_copies == 1


def test_empty_inputs():
    for rows in ([], [torch.zeros(0, dtype=torch.int64)], [torch.tensor([]), []]):
        tree = build_prefix_tree(rows)
        assert tree.num_tree_tokens == 0 and tree.row_offsets.tolist() == [0] * (len(rows) + 1)
        assert tree_attention_mask(tree).shape == (0, 0)
        assert [v.shape for v in gather_rows(tree, torch.zeros(0, 3))] == [(0, 3)] * len(rows)
        assert gather_padded(tree, torch.zeros(0)).shape == (len(rows), 0)


def test_gradient_of_a_shared_token_sums_over_its_rows():
    tree = build_prefix_tree(_tensors([[1, 2, 3], [1, 2, 4], [1, 9]]))
    values = torch.zeros(tree.num_tree_tokens, requires_grad=True)
    gather_padded(tree, values).sum().backward()
    counts = torch.bincount(tree.row_index, minlength=tree.num_tree_tokens).double()
    assert torch.equal(values.grad.double(), counts) and counts.tolist() == [2, 1, 1, 1, 1, 1, 1]  # [1,2,3,2,4,1,9]


# ---------------------------------------------------------------------------------------------------------------------
# Refused inputs: a TrajInputError naming the field, the value and the fix
# ---------------------------------------------------------------------------------------------------------------------


def _refused(fn, *args, field: str, **kwargs) -> TrajInputError:
    with pytest.raises(TrajInputError) as exc:
        fn(*args, **kwargs)
    assert exc.value.field == field and field in str(exc.value) and "Fix:" in str(exc.value), str(exc.value)
    return exc.value


@pytest.mark.parametrize("fn", [build_prefix_tree, tree_token_count])
def test_refused_rows(fn):
    ok = torch.tensor([1, 2])
    _refused(fn, [ok, torch.ones(2, 3, dtype=torch.long)], field="rows[1]")  # not 1-D
    _refused(fn, [ok, torch.tensor([1.0, 2.0])], field="rows[1]")  # float ids
    _refused(fn, [torch.tensor([True])], field="rows[0]")
    _refused(fn, [ok, np.array([1, 2.5])], field="rows[1]")
    _refused(fn, [ok, "abc"], field="rows[1]")
    _refused(fn, [ok, 3], field="rows[1]")
    err = _refused(fn, [ok, torch.tensor([4, -100, 5])], field="rows[1][1]")  # negative id
    assert "-100" in str(err)
    _refused(fn, torch.ones(2, 3, dtype=torch.long), field="rows")  # a padded batch
    _refused(fn, None, field="rows")
    assert fn([ok, np.array([1, 3], dtype=np.int32), [1, 2, 5], torch.tensor([1], dtype=torch.uint8)]) is not None


def test_refused_tree_values_and_dense_mask_size():
    tree = build_prefix_tree(_tensors([[1, 2, 3], [1, 2, 4]]))
    for bad in (torch.zeros(3), torch.zeros(()), np.zeros(4)):
        for fn in (gather_flat, gather_rows, gather_padded):
            _refused(fn, tree, bad, field="tree_values")
    _refused(gather_padded, tree, torch.zeros(5), length=2, field="length")
    _refused(tree_attention_mask, tree, max_tokens=3, field="tree")
