"""verl_traj.core.kernels.tree_attention: the tree's attention gathered per row equals per-row causal attention (outputs and
gradients), the layout checks, the flex block mask, the guard against trees in a plain varlen attention, and the
benchmark script's output structure. Tries are built by hand here (a Python trie with the branch-copy rule)."""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

import pytest
import torch

from verl_traj.core.errors import TrajInputError
from verl_traj.core.kernels.tree_attention import (TreeAttentionError, check_tree, globalize_subtree_end,
                                           per_row_causal_attention, position_resets_look_like_sequences,
                                           refuse_tree_in_plain_attention, tree_attention, tree_attention_blocks,
                                           tree_attention_pairs, tree_block_mask, tree_branch_points, tree_depths)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_tree_attention.py"


# ------------------------------------------------------------------------------------------ hand-built tries
class Node:
    def __init__(self, token):
        self.token, self.children = token, {}


def build_tree(rows):
    """Trie of ``rows`` serialised depth-first; a token with several children gets, per extra child, a copy of
    itself as its sibling holding that child's subtree. -> (tokens, positions, subtree_end, row_index)."""
    root = Node(None)
    for row in rows:
        node = root
        for t in row:
            node = node.children.setdefault(t, Node(t))
    tokens, positions, ends, index = [], [], [], {}

    def emit(node, depth):
        kids = list(node.children.values()) or [None]
        for i, kid in enumerate(kids):  # i == 0: the token itself; i > 0: a copy, sibling of the original
            me = len(tokens)
            tokens.append(node.token)
            positions.append(depth)
            ends.append(None)
            index[(id(node), None if kid is None else kid.token)] = me
            if i == 0:
                index[(id(node), None)] = me
            if kid is not None:
                emit(kid, depth + 1)
            ends[me] = len(tokens) - 1

    for top in root.children.values():
        emit(top, 0)
    row_index = []
    for row in rows:
        node, idx = root, []
        for j, t in enumerate(row):
            node = node.children[t]
            idx.append(index[(id(node), row[j + 1] if j + 1 < len(row) else None)])
        row_index.append(idx)
    return tokens, positions, ends, row_index


def rope(x, pos):
    """Rotary embedding of ``x`` ``[L, H, D]`` at positions ``pos`` ``[L]``."""
    half = x.shape[-1] // 2
    freq = 1.0 / (10000 ** (torch.arange(half, dtype=x.dtype) / half))
    ang = pos.to(x.dtype)[:, None] * freq[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Model:
    """Token embedding + q/k/v projections + rotary: per-token features, so a token's q/k/v depend only on its
    id and position (the copy at a branch has the original's K/V)."""

    def __init__(self, dtype, hq=4, hkv=2, d=8, vocab=50, dm=16, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.hq, self.hkv, self.d = hq, hkv, d
        self.emb = torch.randn(vocab, dm, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
        self.w = [torch.randn(dm, h * d, generator=g, dtype=torch.float64).to(dtype) / dm ** 0.5
                  for h in (hq, hkv, hkv)]

    def qkv(self, tokens, pos):
        x = self.emb[torch.as_tensor(tokens)]
        q, k, v = (torch.matmul(x, w).view(len(tokens), -1, self.d) for w in self.w)
        return rope(q, pos), rope(k, pos), v


def row_weights(rows, model, dtype):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(len(r), model.hq, model.d, generator=g, dtype=torch.float64).to(dtype) for r in rows]


def per_row_loss(rows, model, weights):
    outs = []
    for r in rows:
        q, k, v = model.qkv(r, torch.arange(len(r)))
        outs += per_row_causal_attention([q], [k], [v])
    loss = sum(((o * w).sum() + (o ** 2).sum() * 0.1) for o, w in zip(outs, weights))
    return outs, loss


def tree_loss(rows, model, weights, block, pack=None):
    tokens, pos, ends, row_index = pack or build_tree(rows)
    se = torch.tensor(ends)
    check_tree(se, torch.tensor(pos))
    q, k, v = model.qkv(tokens, torch.tensor(pos))
    out = tree_attention(q, k, v, se, block=block)
    outs = [out[torch.tensor(idx)] for idx in row_index]
    loss = sum(((o * w).sum() + (o ** 2).sum() * 0.1) for o, w in zip(outs, weights))
    return outs, loss


def assert_tree_equals_rows(rows, dtype=torch.float64, block=3, hq=4, hkv=2, pack=None, atol=None):
    atol = atol or (1e-12 if dtype == torch.float64 else 1e-5)
    model = Model(dtype, hq=hq, hkv=hkv)
    weights = row_weights(rows, model, dtype)
    ref_outs, ref_loss = per_row_loss(rows, model, weights)
    (ref_grad,) = torch.autograd.grad(ref_loss, model.emb)
    outs, loss = tree_loss(rows, model, weights, block, pack)
    (grad,) = torch.autograd.grad(loss, model.emb)
    for o, r in zip(outs, ref_outs):
        torch.testing.assert_close(o, r, atol=atol, rtol=0)
    scale = ref_grad.abs().max()
    torch.testing.assert_close(grad / scale, ref_grad / scale, atol=atol, rtol=0)


PROMPT = list(range(1, 13))
CASES = {
    "branch_in_prompt": [PROMPT[:6] + [30, 31, 32, 40, 41], PROMPT + [40, 42, 43], PROMPT + [44, 45]],
    "branch_in_responses": [PROMPT + [20, 21, 22, 23], PROMPT + [20, 21, 24, 25, 26], PROMPT + [27, 28],
                            PROMPT + [20, 29]],
    "branch_at_root_token": [[1, 2, 3, 4], [1, 5, 6], [1, 2, 7]],
    "identical_rows": [PROMPT + [20, 21]] * 3,
    "row_is_prefix_of_another": [PROMPT, PROMPT + [20, 21, 22], PROMPT[:5] + [33]],
    "share_nothing": [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15]],
    "one_row": [PROMPT + [20, 21, 22]],
}


# --------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("block", [1, 3, 128])
def test_tree_equals_per_row_fp64(case, block):
    assert_tree_equals_rows(CASES[case], torch.float64, block)


@pytest.mark.parametrize("case", sorted(CASES))
def test_tree_equals_per_row_fp32(case):
    assert_tree_equals_rows(CASES[case], torch.float32, block=4)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (4, 1)])
def test_gqa_and_mqa(hq, hkv):
    assert_tree_equals_rows(CASES["branch_in_responses"], torch.float64, block=5, hq=hq, hkv=hkv)


def test_hand_trie_layout():
    """Branch-copy rule by hand: [1,2,3] and [1,2,4] -> 1 2 3 | 2' 4 (2' a sibling of 2 under 1)."""
    tokens, pos, ends, row_index = build_tree([[1, 2, 3], [1, 2, 4]])
    assert tokens == [1, 2, 3, 2, 4] and pos == [0, 1, 2, 1, 2] and ends == [4, 2, 2, 4, 4]
    assert row_index == [[0, 1, 2], [0, 3, 4]]
    assert tree_depths(torch.tensor(ends)).tolist() == pos
    tokens, pos, ends, _ = build_tree(CASES["share_nothing"])  # a forest of chains == the concatenation
    assert tokens == sum(CASES["share_nothing"], []) and ends == [4] * 5 + [7] * 3 + [14] * 7
    assert build_tree(CASES["identical_rows"])[0] == CASES["identical_rows"][0]


def test_several_trees_packed():
    """Trees packed one after another with global subtree ends (globalize_subtree_end from per-tree ends)."""
    groups = [CASES["branch_in_prompt"], CASES["branch_in_responses"], CASES["one_row"]]
    tokens, pos, local, row_index, offsets = [], [], [], [], [0]
    for rows in groups:
        t, p, e, idx = build_tree(rows)
        row_index += [[i + offsets[-1] for i in r] for r in idx]
        tokens, pos, local = tokens + t, pos + p, local + e
        offsets.append(offsets[-1] + len(t))
    ends = globalize_subtree_end(torch.tensor(local), torch.tensor(offsets))
    assert ends.tolist() == [e + offsets[g] for g, rows in enumerate(groups) for e in build_tree(rows)[2]]
    assert_tree_equals_rows(sum(groups, []), torch.float64, block=7, pack=(tokens, pos, ends.tolist(), row_index))


def test_random_tries_fp64_and_bench_builder():
    """Random rows over a small vocabulary (many shared prefixes and branches); the benchmark's iterative
    builder gives the same layout as the hand one."""
    bench_build = load_bench().build_tree
    g = torch.Generator().manual_seed(3)
    for trial in range(6):
        base = torch.randint(3, (30,), generator=g).tolist()
        rows = [base[:int(torch.randint(1, 30, (), generator=g))] + torch.randint(3, (int(torch.randint(1, 12, (),
                generator=g)),), generator=g).tolist() for _ in range(5)]
        layout = build_tree(rows)
        assert tuple(bench_build(rows)) == layout
        assert_tree_equals_rows(rows, torch.float64, block=1 + trial * 3)


def test_gradcheck_and_bf16():
    g = torch.Generator().manual_seed(0)
    se = torch.tensor(build_tree([[1, 2, 3, 4], [1, 2, 5], [1, 6, 7], [8, 9]])[2])
    n = len(se)
    q, k, v = (torch.randn(n, h, 3, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    assert torch.autograd.gradcheck(lambda q, k, v: tree_attention(q, k, v, se, block=3, scale=0.7), (q, k, v))
    se = torch.tensor(build_tree(CASES["branch_in_responses"])[2])
    n = len(se)
    q, k, v = (torch.randn(n, h, 4, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    out16 = tree_attention(*(x.detach().bfloat16() for x in (q, k, v)), se)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.double(), tree_attention(q, k, v, se).detach(), atol=3e-2, rtol=0)


def test_blocks_reuse_and_shape_errors():
    se = torch.tensor(build_tree(CASES["branch_in_prompt"])[2])
    n = len(se)
    q, k = torch.randn(n, 2, 4), torch.randn(n, 1, 4)
    blocks = tree_attention_blocks(se, 4)
    torch.testing.assert_close(tree_attention(q, k, k, se, blocks=blocks), tree_attention(q, k, k, se, block=16))
    with pytest.raises(TreeAttentionError, match="blocks"):
        tree_attention(q[:-1], k[:-1], k[:-1], se[:-1], blocks=blocks)
    with pytest.raises(TrajInputError, match="Hq % Hkv"):
        tree_attention(torch.randn(n, 3, 4), k.expand(n, 2, 4), k.expand(n, 2, 4), se)
    n_pairs = sum(len(build_tree([r])[0]) * (len(r) + 1) // 2 for r in CASES["share_nothing"])
    assert tree_attention_pairs(torch.tensor(build_tree(CASES["share_nothing"])[2])) == n_pairs


def test_check_tree_refuses_bad_layouts():
    check_tree(torch.tensor([4, 2, 2, 4, 4]), torch.tensor([[0, 1, 2, 1, 2]]))
    for bad, match in [(torch.tensor([4, 0, 2, 4, 4]), r"subtree_end\[1\]=0"),
                       (torch.tensor([4, 2, 2, 4, 5]), r"outside \[4, 4\]"),
                       (torch.tensor([3, 2, 4, 3, 4]), "nest"),
                       (torch.tensor([3, 1, 2, 4, 4]), r"subtree \[0, 3\]"),
                       (torch.tensor([4.0, 2, 2, 4, 4]), "1-D integer")]:
        with pytest.raises(TreeAttentionError, match=match) as err:
            check_tree(bad)
        assert err.value.field == "subtree_end"
    with pytest.raises(TreeAttentionError, match="depths") as err:
        check_tree(torch.tensor([4, 2, 2, 4, 4]), torch.tensor([0, 1, 2, 3, 4]))
    assert err.value.field == "position_ids"


def test_check_tree_nesting_against_brute_force():
    g = torch.Generator().manual_seed(5)
    seen = set()
    for _ in range(300):
        n = int(torch.randint(1, 12, (), generator=g))
        se = torch.tensor([int(torch.randint(k, n, (), generator=g)) for k in range(n)])
        nested = all(not (j < k <= se[j] < se[k]) for k in range(n) for j in range(k))
        try:
            check_tree(se)
            ok = True
        except TreeAttentionError:
            ok = False
        assert ok == nested, se.tolist()
        seen.add(ok)
    assert seen == {True, False}


def dense_mask(se):
    i = torch.arange(len(se))
    return (i[None, :] <= i[:, None]) & (i[:, None] <= se[None, :])


@pytest.mark.parametrize("case", ["branch_in_prompt", "branch_in_responses", "share_nothing"])
@pytest.mark.parametrize("block", [2, 4, 16])
def test_flex_block_mask_matches_dense(case, block):
    """Every block holding a visible pair is listed; every block listed as full is fully visible."""
    rows = CASES[case] * 3  # longer, several blocks
    se = torch.tensor(build_tree(rows)[2] if case != "share_nothing" else
                      [e + 15 * r for r in range(3) for e in build_tree(CASES[case])[2]])
    n = len(se)
    nb = -(-n // block)
    dense = torch.nn.functional.pad(dense_mask(se), (0, nb * block - n, 0, nb * block - n))
    blocks = dense.view(nb, block, nb, block).permute(0, 2, 1, 3).reshape(nb, nb, -1)
    mask = tree_block_mask(se, block)
    assert torch.equal(mask.to_dense()[0, 0].bool(), blocks.any(-1))
    counts, idx = mask.full_kv_num_blocks[0, 0], mask.full_kv_indices[0, 0]
    for qb in range(nb):
        for kb in idx[qb, :counts[qb]].tolist():
            assert bool(blocks[qb, kb].all())
    q, k = torch.randn(1, 2, n, 4, dtype=torch.float64), torch.randn(1, 2, n, 4, dtype=torch.float64)
    from torch.nn.attention.flex_attention import flex_attention
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex = flex_attention(q, k, k, block_mask=mask)[0].transpose(0, 1)
    torch.testing.assert_close(flex, tree_attention(q[0].transpose(0, 1), k[0].transpose(0, 1),
                                                    k[0].transpose(0, 1), se), atol=1e-12, rtol=0)


def test_guard_refuses_tree_positions():
    _, pos, ends, _ = build_tree(CASES["branch_in_responses"])
    assert not position_resets_look_like_sequences(torch.tensor(pos))
    with pytest.raises(TreeAttentionError, match="tree attention") as err:
        refuse_tree_in_plain_attention(torch.tensor([pos]), where="cpu_varlen")
    assert err.value.field == "position_ids" and "cpu_varlen" in str(err.value)
    assert isinstance(err.value, TrajInputError)
    first = tree_branch_points(torch.tensor(pos))[0, 1]
    assert pos[first] == len(PROMPT) + 1 and pos[first - 1] > pos[first]  # the copy of token 21 (depth 13)


def test_guard_accepts_plain_packing_and_padding():
    packed = torch.cat([torch.arange(5), torch.arange(3), torch.arange(7)])
    assert position_resets_look_like_sequences(packed)
    refuse_tree_in_plain_attention(packed[None])
    right_padded = torch.tensor([[0, 1, 2, 3, 3, 3], [0, 0, 0, 0, 1, 2]])  # verl's clip(cumsum - 1, 0)
    refuse_tree_in_plain_attention(right_padded)
    with pytest.raises(TreeAttentionError, match="row 1, index 4"):
        refuse_tree_in_plain_attention(torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 2, 3]]))
    with pytest.raises(TreeAttentionError, match=r"\[N\] or \[b, N\]"):
        tree_branch_points(torch.zeros(3, 1, 4, dtype=torch.long))


def test_guard_is_exact_against_cpu_varlen():
    """Where the guard passes (branches only at depth 0) the plain varlen mask IS the tree mask; where it refuses,
    cpu_varlen's mask differs (the silent error the guard prevents)."""
    from verl_traj.cpu.attention import allowed_keys

    for case, rows in [("root", [[1, 2, 3], [1, 5, 6, 7], [1, 8]]), ("share_nothing", CASES["share_nothing"]),
                       ("deeper", CASES["branch_at_root_token"]), ("deeper", CASES["branch_in_prompt"])]:
        _, pos, ends, _ = build_tree(rows)
        p = torch.tensor([pos])
        plain = allowed_keys(1, len(pos), len(pos), is_causal=True, attention_mask=None, position_ids=p,
                             device=torch.device("cpu"))[0]
        same = torch.equal(plain, dense_mask(torch.tensor(ends)))
        assert same == position_resets_look_like_sequences(p) == (case != "deeper")


# ----------------------------------------------------------------------------------------------- benchmark
def load_bench():
    if "bench_tree_attention" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_tree_attention", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_tree_attention"] = module
        spec.loader.exec_module(module)
    return sys.modules["bench_tree_attention"]


def test_bench_script_quick_json(capsys):
    bench = load_bench()
    threads = torch.get_num_threads()
    try:
        result = bench.run(["--quick", "--json", "--repeats", "1", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    assert result["config"]["quick"] and result["config"]["device"] == "cpu"
    records = result["records"]
    variants = {"tree/blocked", "rows/blocked", "tree/sdpa", "rows/sdpa"}
    assert {(r["workload"], r["variant"]) for r in records} == {(w, v) for w in ("grpo-4", "grpo-8", "steps")
                                                                for v in variants}
    for r in records:
        assert {"tokens", "pairs", "seconds", "times", "speedup_vs_rows_same_kernel", "max_err", "tree_tokens",
                "row_tokens"} <= r.keys()
        assert r["max_err"] < 1e-4 and r["seconds"] > 0
        tree = r["variant"].startswith("tree")
        assert r["tokens"] == r["tree_tokens" if tree else "row_tokens"]
        assert (r["tree_tokens"] < r["row_tokens"]) and (r["tree_pairs"] < r["row_pairs"])
    grpo = next(r for r in records if r["workload"] == "grpo-8")
    assert grpo["tree_tokens"] == 256 + 8 * 64 + 7  # prompt once, 7 copies of its last token
    assert "| workload |" in bench.table(result)
