"""verl_traj.core.kernels.tree_attention on CUDA: the blocked ``tree_attention`` (forward + backward) and compiled
``flex_attention`` with ``tree_block_mask`` against per-row causal attention, on trees from
:func:`verl_traj.core.trees.prefix_tree.build_prefix_tree` (GRPO group, step rows with branches, identical / prefix rows,
rows sharing nothing), GQA heads.

Reference: :func:`per_row_causal_attention` in fp64 on the same device, each row's q / k / v gathered from the
tree's leaves with ``row_index`` (so the gradients of both sides land on the same tree leaves). fp32 must match to
1e-4 (relative to the largest reference value); bf16 is reported and held to a loose bound (4x the error of
per-row bf16 sdpa, at least 2e-2 relative). Every tree is padded to ``N_PAD`` tokens with single-token roots (a
valid forest, the last 128-block partial: the blocked kernel and the block-mask check see it). Flex runs as production
runs it (:mod:`verl_traj.core.kernels.tree_flex`: the tree padded on to the 1,024 bucket, symbolic length, dynamo's default
recompile limit, a limit hit raises instead of running the dense eager path): one kernel per dtype and grad mode.

Skipped without CUDA (``VERL_TRAJ_TREE_ATTN_DEVICE=cpu`` runs the same checks on the CPU, flex excepted: it has no
CPU backward). With
``VERL_TRAJ_TREE_ATTN_REPORT=<path>`` the measured errors are written there as JSON (and printed with ``-s``).
Torch, numpy and verl_traj.core only.
"""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch

from verl_traj.core.trees.prefix_tree import build_prefix_tree
from verl_traj.core.kernels.tree_attention import (check_tree, per_row_causal_attention, tree_attention, tree_block_mask)

DEVICE = os.environ.get("VERL_TRAJ_TREE_ATTN_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                reason="needs CUDA (VERL_TRAJ_TREE_ATTN_DEVICE=cpu runs it on the CPU)")

N_PAD, HQ, HKV, D = 1000, 8, 2, 64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _ids(gen, n, offset=0):
    return (torch.randint(1000, (n,), generator=gen) + offset).tolist()


@functools.lru_cache(maxsize=None)
def cases():
    gen = torch.Generator().manual_seed(0)
    prompt = _ids(gen, 200)
    grpo = [prompt + [1000 + i] + _ids(gen, 99) for i in range(6)]  # one prompt, 6 responses
    context, steps = _ids(gen, 100), []
    for turn in range(5):  # one row per LLM call; actions 1 and 3 re-encoded in the next context: a branch
        prompt_t = context + _ids(gen, 20)
        action = _ids(gen, 30)
        steps.append(prompt_t + action)
        if turn in (1, 3):
            action = action[:-1] + [action[-1] + 1000]
        context = prompt_t + action
    a = _ids(gen, 300)
    identical = [a, list(a), a[:150], a[:50] + _ids(gen, 150, 1000), list(a)]  # duplicates, a prefix row, a branch
    forest = [_ids(gen, 200, 2000), _ids(gen, 250, 3000), _ids(gen, 120, 4000)]  # nothing shared: packed chains
    two_groups = [p + [1000 + i] + _ids(gen, 59) for p in (_ids(gen, 150), _ids(gen, 150, 5000)) for i in range(3)]
    return {"grpo": grpo, "steps": steps, "identical_rows": identical, "share_nothing": forest,
            "two_groups": two_groups}


@functools.lru_cache(maxsize=None)
def setup(case):
    """Padded ``subtree_end`` on the device, ``row_index``, row lengths, fp64 leaves, upstream row weights, and the
    fp64 per-row reference (outputs gathered per row token, gradients of the tree leaves)."""
    rows = cases()[case]
    tree = build_prefix_tree([torch.tensor(r) for r in rows])
    n = tree.num_tree_tokens
    assert n <= N_PAD and (tree.num_row_tokens > n or case == "share_nothing"), (case, n)
    se = torch.cat([tree.subtree_end, torch.arange(n, N_PAD)])  # padding: single-token roots
    pos = torch.cat([tree.position_ids, torch.zeros(N_PAD - n, dtype=torch.long)])
    check_tree(se, pos)
    gen = torch.Generator().manual_seed(1)
    leaves = tuple(torch.randn(N_PAD, h, D, generator=gen, dtype=torch.float64).to(DEVICE) for h in (HQ, HKV, HKV))
    weights = torch.randn(tree.num_row_tokens, HQ, D, generator=gen, dtype=torch.float64).to(DEVICE)
    ri, lens = tree.row_index.to(DEVICE), tree.row_lengths.tolist()
    ref_out, ref_grads = run_rows(leaves, ri, lens, weights)
    return se.to(DEVICE), ri, lens, leaves, weights, ref_out, ref_grads


def run_rows(leaves, ri, lens, weights, dtype=torch.float64):
    """Per-row causal sdpa on the rows gathered from the tree leaves cast to ``dtype`` -> (outputs ``[T, Hq, D]``,
    gradients of the tree leaves), both fp64."""
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in leaves)
    rows = [list(x[ri].split(lens)) for x in (q, k, v)]
    out = torch.cat(per_row_causal_attention(*rows))
    (out.double() * weights).sum().backward()
    return out.detach().double(), tuple(x.grad.double() for x in (q, k, v))


def run_tree(leaves, ri, weights, dtype, attend):
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in leaves)
    out = attend(q, k, v)
    assert out.dtype == dtype and out.shape == q.shape
    (out[ri].double() * weights).sum().backward()
    return out.detach()[ri].double(), tuple(x.grad.double() for x in (q, k, v))


def rel_err(x, ref):
    return float((x - ref).abs().max() / ref.abs().max())


@pytest.fixture(scope="module")
def report():
    records = []
    yield records
    if not records:
        return
    print("\n[tree_attention_cuda] max |err| / max |ref| against the fp64 per-row reference "
          f"(device={DEVICE}, N={N_PAD}, heads {HQ}/{HKV}x{D}):")
    print(f"  {'case':<15} {'dtype':<9} {'variant':<13} {'out':>9} {'dq':>9} {'dk':>9} {'dv':>9} {'out abs':>9}")
    for r in records:
        print(f"  {r['case']:<15} {r['dtype']:<9} {r['variant']:<13} {r['out']:9.2e} {r['dq']:9.2e} {r['dk']:9.2e} "
              f"{r['dv']:9.2e} {r['out_abs']:9.2e}")
    path = os.environ.get("VERL_TRAJ_TREE_ATTN_REPORT")
    if path:
        device = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
        with open(path, "w") as f:
            json.dump(dict(device=device, torch=torch.__version__, n=N_PAD, heads=HQ, kv_heads=HKV, head_dim=D,
                           records=records), f, indent=1)


@pytest.fixture(scope="module")
def flex():
    """Compiled ``flex_attention`` with ``tree_block_mask`` as production calls it
    (:func:`~verl_traj.core.kernels.tree_flex.flex_tree_attention`: symbolic length, ``fullgraph``, dynamo's default recompile
    limit, a limit hit raises instead of running the eager path), on the tree padded as production pads it (to a
    multiple of ``BUCKET`` with single-token roots; ``tree_block_mask``'s partial last block is checked below)."""
    from verl_traj.core.kernels.tree_flex import bucketed, flex_tree_attention

    def attend(q, k, v, se):
        n, pad = se.numel(), bucketed(se.numel()) - se.numel()
        mask = tree_block_mask(torch.cat([se, torch.arange(n, n + pad, device=se.device)]), 128)
        qkv = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1)[None] for x in (q, k, v))
        return flex_tree_attention(*qkv, mask)[0].transpose(0, 1)[:n]

    return attend


def check(case, dtype_name, variant, attend, report):
    dtype = DTYPES[dtype_name]
    se, ri, lens, leaves, weights, ref_out, ref_grads = setup(case)
    out, grads = run_tree(leaves, ri, weights, dtype, lambda q, k, v: attend(q, k, v, se))
    errs = dict(out=rel_err(out, ref_out), **{n: rel_err(g, r) for n, g, r in zip(("dq", "dk", "dv"), grads,
                                                                                    ref_grads)})
    report.append(dict(case=case, dtype=dtype_name, variant=variant, **errs,
                       out_abs=float((out - ref_out).abs().max())))
    if dtype == torch.float32:
        bound = dict.fromkeys(errs, 1e-4)
    else:
        rows_out, rows_grads = run_rows(leaves, ri, lens, weights, dtype)
        base = dict(out=rel_err(rows_out, ref_out), **{n: rel_err(g, r) for n, g, r in zip(("dq", "dk", "dv"),
                                                                                            rows_grads, ref_grads)})
        if variant == "tree/blocked":
            report.append(dict(case=case, dtype=dtype_name, variant="rows/sdpa", **base,
                               out_abs=float((rows_out - ref_out).abs().max())))
        bound = {n: max(4 * base[n], 2e-2) for n in errs}
    bad = {n: (e, bound[n]) for n, e in errs.items() if not e <= bound[n]}
    assert not bad, f"{variant} {dtype_name} {case}: (relative error, bound) {bad}"


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("case", sorted(cases()))
def test_blocked_tree_attention_equals_rows(case, dtype_name, report):
    check(case, dtype_name, "tree/blocked", lambda q, k, v, se: tree_attention(q, k, v, se, block=128), report)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("case", sorted(cases()))
def test_flex_tree_block_mask_equals_rows(case, dtype_name, flex, report):
    if DEVICE == "cpu":
        pytest.skip("flex_attention has no backward on the CPU")
    check(case, dtype_name, "tree/flex", flex, report)


@pytest.mark.parametrize("case", sorted(cases()))
def test_block_mask_on_device_matches_dense(case):
    se = setup(case)[0]
    nb = -(-N_PAD // 128)
    i = torch.arange(N_PAD, device=se.device)
    dense = (i[None, :] <= i[:, None]) & (i[:, None] <= se[None, :])
    dense = torch.nn.functional.pad(dense, (0, nb * 128 - N_PAD, 0, nb * 128 - N_PAD))
    blocks = dense.view(nb, 128, nb, 128).permute(0, 2, 1, 3).reshape(nb, nb, -1)
    mask = tree_block_mask(se, 128)
    assert torch.equal(mask.to_dense()[0, 0].bool(), blocks.any(-1))
    counts, idx = mask.full_kv_num_blocks[0, 0], mask.full_kv_indices[0, 0]
    for qb in range(nb):
        for kb in idx[qb, :counts[qb]].tolist():
            assert bool(blocks[qb, kb].all())


# ---- the engine's CUDA kernel: verl_traj.core.kernels.tree_flex (dynamic length, one compile per dtype and grad mode) -----

@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("case", sorted(cases()))
def test_engine_flex_kernel_equals_rows(case, dtype_name, report):
    """:func:`~verl_traj.core.kernels.tree_flex.tree_attention_flex` (what the engine path calls on CUDA): N=1000 padded to
    one 1024 bucket, the same accuracy bound as the blocked kernel."""
    if DEVICE == "cpu":
        pytest.skip("flex_attention has no backward on the CPU")
    from verl_traj.core.kernels.tree_flex import FlexTree, tree_attention_flex

    check(case, dtype_name, "engine/flex", lambda q, k, v, se: tree_attention_flex(q, k, v, FlexTree(se)), report)


def test_engine_flex_compiles_once_per_dtype_and_grad_mode(monkeypatch):
    """Trees of different sizes and shapes, in one bucket and in the next (2,048: two trees packed), reuse one compiled
    kernel (the length is symbolic: a recompile per size would cost seconds each and reach dynamo's recompile limit
    within a few steps), never flex's eager path; outputs stay exact (fp32) after the reuse."""
    if DEVICE == "cpu":
        pytest.skip("flex_attention has no backward on the CPU")
    import torch.nn.attention.flex_attention as flex_module
    from torch._dynamo.utils import counters

    from verl_traj.core.kernels.tree_flex import FlexTree, tree_attention_flex

    eager = []
    monkeypatch.setattr(flex_module, "_warn_once", lambda warning_id, *args, **kwargs: eager.append(warning_id))

    def run(se):
        n = se.numel()
        gen = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(n, h, D, generator=gen).to(DEVICE).requires_grad_() for h in (HQ, HKV, HKV))
        out = tree_attention_flex(q, k, v, FlexTree(se))
        out.sum().backward()
        ref = tree_attention(q.detach().double(), k.detach().double(), v.detach().double(), se)
        assert rel_err(out.detach().double(), ref) < 1e-4
        return int(counters["stats"]["unique_graphs"])

    trees = [setup(case)[0] for case in sorted(cases())]
    first = run(trees[0])
    sizes = [run(se[:m]) for se, m in zip(trees[1:], (1000, 900, 1000, 700))
             if bool((se[:m] < m).all())]  # a prefix of a forest whose subtrees end inside it
    assert sizes and all(s == first for s in sizes), (first, sizes)
    big = torch.cat([trees[0], trees[1] + N_PAD])  # two trees packed: 2000 tokens, the 2048 bucket
    assert run(big) == first and not eager, eager
