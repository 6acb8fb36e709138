"""The engine's CUDA tree kernel (:mod:`verl_traj.core.kernels.tree_flex`), forward on the CPU (torch's flex attention has a
CPU forward, no CPU backward; the backward and bf16 run in tests/core/test_tree_attention_cuda.py on a GPU): random
prefix trees of different sizes equal the blocked reference kernel; trees of any size share one compiled kernel per
grad mode, at dynamo's production settings (recompile limit 8), and never take flex's eager path (the dense
``[H, N, N]`` scores); a kernel past the limit stops with a :class:`TreeAttentionError`.

All calls use one head layout (4 / 2 heads x 16, fp32), so the module pays one CPU compile (seconds) per grad mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
from torch._dynamo.utils import counters

from verl_traj.core.kernels import tree_flex
from verl_traj.core.trees.prefix_tree import build_prefix_tree
from verl_traj.core.kernels.tree_attention import TreeAttentionError, tree_attention
from verl_traj.core.kernels.tree_flex import BUCKET, FlexTree, bucketed, flex_kernels, flex_tree_attention, tree_attention_flex

HEADS, D = (4, 2, 2), 16
# (prompt, responses, response length): GRPO groups of 60 to 4,711 tree tokens, 9 sizes over 5 buckets of 1,024
GROUPS = ((40, 1, 20), (100, 4, 150), (60, 5, 210), (200, 8, 220), (100, 12, 200), (300, 9, 300), (64, 16, 190),
          (500, 8, 460), (128, 24, 190))


def _tree(seed: int):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(50, (int(torch.randint(5, 60, (1,), generator=gen)),), generator=gen)
    rows = [torch.cat([prompt[: int(torch.randint(1, len(prompt) + 1, (1,), generator=gen))],
                       torch.randint(50, (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen)])
            for _ in range(int(torch.randint(1, 9, (1,), generator=gen)))]
    return build_prefix_tree(rows).subtree_end


def _group(prompt: int, responses: int, length: int, seed: int) -> torch.Tensor:
    """``subtree_end`` of a GRPO group's tree: one prompt, ``responses`` rows of ``length`` tokens after it."""
    gen = torch.Generator().manual_seed(seed)
    head = torch.randint(50, (prompt,), generator=gen)
    rows = [torch.cat([head, torch.tensor([50 + i]), torch.randint(50, (length - 1,), generator=gen)])
            for i in range(responses)]
    return build_prefix_tree(rows).subtree_end


def _qkv(n: int, seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(n, h, D, generator=gen, dtype=dtype) for h in HEADS)


@pytest.fixture
def eager_calls(monkeypatch):
    """Every call of flex_attention's eager path (it warns through ``_warn_once`` before materialising the scores;
    a compiled call never reaches it)."""
    calls = []
    monkeypatch.setattr(flex_module, "_warn_once", lambda warning_id, *args, **kwargs: calls.append(warning_id))
    return calls


def test_flex_kernel_forward_equals_the_blocked_kernel_and_compiles_once_per_bucket(eager_calls):
    graphs = []
    for seed in range(6):
        se = _tree(seed)
        n = se.numel()
        assert bucketed(n) == BUCKET
        q, k, v = _qkv(n, 100 + seed)
        with torch.no_grad():
            out = tree_attention_flex(q, k, v, FlexTree(se))
        ref = tree_attention(q, k, v, se)
        assert out.shape == q.shape and float((out - ref).abs().max()) < 1e-5
        graphs.append(int(counters["stats"]["unique_graphs"]))
    assert graphs[1:] == graphs[:1] * 5, graphs  # trees 2..6: no new graph
    assert not eager_calls


def test_any_tree_size_in_both_grad_modes_compiles_one_kernel_per_mode_and_never_runs_eager(eager_calls):
    """9 tree sizes over 5 buckets, each with grad disabled (old log-probs) and enabled (the update's mode; on CPU its
    inputs cannot require grad): 18 calls, at most 2 new graphs (one per grad mode), all compiled. A compile per
    bucket would hit the recompile limit (8) at the 5th bucket and run the dense eager path from then on."""
    before = int(counters["stats"]["unique_graphs"])
    sizes = set()
    for i, spec in enumerate(GROUPS):
        se = _group(*spec, seed=i)
        n = se.numel()
        sizes.add(n)
        q, k, v = _qkv(n, 200 + i)
        outs = []
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                outs.append(tree_attention_flex(q, k, v, FlexTree(se)))
        assert torch.equal(outs[0], outs[1]) and bool(outs[0].isfinite().all())
        if i % 3 == 0:  # the reference costs seconds at these sizes on CPU: three sizes, three buckets
            assert float((outs[0] - tree_attention(q, k, v, se)).abs().max()) < 1e-5, n
    assert len(sizes) == len(GROUPS) and len({bucketed(n) for n in sizes}) == 5, sizes
    assert not eager_calls, f"flex_attention ran eagerly {len(eager_calls)} times"
    assert int(counters["stats"]["unique_graphs"]) - before <= 2
    keys = {key for key in flex_kernels() if key.heads == (4, 2, D) and key.dtype == torch.float32}
    assert {key.grad_enabled for key in keys} == {False, True}


def test_a_kernel_past_the_recompile_limit_stops_before_compiling(eager_calls):
    """verl_traj's own count: a new kernel (fp64) when the limit is already used up raises, naming the fix, and
    compiles nothing."""
    se = _tree(0)
    q, k, v = _qkv(se.numel(), 1, torch.float64)
    before = int(counters["stats"]["unique_graphs"])
    with torch._dynamo.config.patch(recompile_limit=len(flex_kernels())), torch.no_grad():
        with pytest.raises(TreeAttentionError, match="already compiled") as err:
            tree_attention_flex(q, k, v, FlexTree(se))
    assert err.value.field == "q" and "float64" in str(err.value) and "Fix:" in str(err.value)
    assert int(counters["stats"]["unique_graphs"]) == before and not eager_calls


def test_a_dynamo_limit_hit_raises_instead_of_running_eager(eager_calls, monkeypatch):
    """Dynamo's own limit (say other compiled flex_attention calls in the process filled the cache; here: verl_traj's
    count forgotten, limit 1): the compiled call is ``fullgraph``, so the hit raises; it is reported as a
    :class:`TreeAttentionError`, never the eager path."""
    se = _tree(1)
    n = se.numel()
    with torch.no_grad():
        tree_attention_flex(*_qkv(n, 2), FlexTree(se))  # at least one compiled entry (shared with the tests above)
    monkeypatch.setattr(tree_flex, "_KERNELS", set())
    with torch._dynamo.config.patch(recompile_limit=1), torch.no_grad():
        with pytest.raises(TreeAttentionError, match="another compiled flex_attention") as err:
            tree_attention_flex(*_qkv(n, 3, torch.float64), FlexTree(se))
    assert err.value.field == "q" and "Fix:" in str(err.value)
    assert not eager_calls


def test_a_length_off_the_bucket_grid_is_refused():
    """Only lengths that are multiples of ``BUCKET`` reach the compiled kernel (torch 2.13's CPU template does not even
    compile a symbolic length of 1,000); the refusal names the field and the fix, and compiles nothing."""
    se = _tree(2)
    q, k, v = (torch.randn(1, h, 1000, D) for h in HEADS)
    with pytest.raises(TreeAttentionError, match="multiple of 1024") as err:
        flex_tree_attention(q, k, v, FlexTree(se).block_mask)
    assert err.value.field == "q" and "Fix:" in str(err.value)


def test_a_tree_micro_batch_past_the_recompile_limit_runs_the_blocked_kernel_and_training_goes_on(eager_calls, caplog):
    """Issue 55, item 2: where a new flex kernel would pass the recompile limit, the tree call takes the blocked
    kernel (exact: the same output as it), counted per micro-batch (``fallbacks``) and warned once; it neither raises
    nor compiles nor runs flex's eager path."""
    import logging

    from verl_traj.core.kernels import tree_kernel

    se = _tree(2)
    q, k, v = _qkv(se.numel(), 4, torch.float64)
    tree = tree_kernel.TreeAttentionInput(se)
    tree.flex, tree.blocks = FlexTree(se), None  # what a CUDA micro-batch holds (flex, no key sets yet)
    before = int(counters["stats"]["unique_graphs"])
    with torch._dynamo.config.patch(recompile_limit=len(flex_kernels())), torch.no_grad(), \
            caplog.at_level(logging.WARNING, logger=tree_kernel.__name__):
        outs = [tree_kernel._tree_call(tree, q[None], k[None], v[None], None, {}) for _ in range(2)]
    torch.testing.assert_close(outs[0][0], tree_attention(q, k, v, se))
    assert tree.fallbacks == 2 and tree.calls == 2 and tree.blocks is not None
    assert int(counters["stats"]["unique_graphs"]) == before and not eager_calls
    assert sum("recompile_limit" in r.getMessage() for r in caplog.records) <= 1
