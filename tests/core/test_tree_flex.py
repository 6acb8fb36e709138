"""The engine's CUDA tree kernel (:mod:`verl_traj.core.tree_flex`), forward on the CPU (torch's flex attention has a
CPU forward, no CPU backward; the backward and bf16 run in tests/core/test_tree_attention_cuda.py on a GPU): random
prefix trees of different sizes equal the blocked reference kernel, and trees of one bucket share one compiled kernel
(a recompile per micro-batch would cost seconds each)."""

from __future__ import annotations

import torch

from verl_traj.core.prefix_tree import build_prefix_tree
from verl_traj.core.tree_attention import tree_attention
from verl_traj.core.tree_flex import BUCKET, FlexTree, bucketed, tree_attention_flex


def _tree(seed: int):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(50, (int(torch.randint(5, 60, (1,), generator=gen)),), generator=gen)
    rows = [torch.cat([prompt[: int(torch.randint(1, len(prompt) + 1, (1,), generator=gen))],
                       torch.randint(50, (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen)])
            for _ in range(int(torch.randint(1, 9, (1,), generator=gen)))]
    return build_prefix_tree(rows).subtree_end


def test_flex_kernel_forward_equals_the_blocked_kernel_and_compiles_once_per_bucket():
    from torch._dynamo.utils import counters

    graphs = []
    for seed in range(6):
        se = _tree(seed)
        n = se.numel()
        assert bucketed(n) == BUCKET
        gen = torch.Generator().manual_seed(100 + seed)
        q, k, v = (torch.randn(n, h, 16, generator=gen) for h in (4, 2, 2))
        with torch.no_grad():
            out = tree_attention_flex(q, k, v, FlexTree(se))
        ref = tree_attention(q, k, v, se)
        assert out.shape == q.shape and float((out - ref).abs().max()) < 1e-5
        graphs.append(int(counters["stats"]["unique_graphs"]))
    assert graphs[1:] == graphs[:1] * 5, graphs  # trees 2..6: no new graph
