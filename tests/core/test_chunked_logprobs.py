"""The chunked fp32 log-softmax (``verl_traj.core.kernels.chunked_logprobs``) that replaces verl's per-token fallback
where flash-attn is missing: the numbers and gradients of one fp32 ``cross_entropy`` over all rows for any chunking,
and scratch bounded by its budget (issue 55, item 3; ``scripts/bench_logprobs.py`` measures the peak)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_traj.core.kernels.chunked_logprobs import chunk_rows, chunked_logprobs


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), vocab=st.integers(2, 300), chunk=st.integers(1, 50),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_any_chunking_gives_cross_entropys_log_probs_and_gradient(rows, vocab, chunk, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(2, rows, vocab, generator=gen) * 4).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (2, rows), generator=gen)
    weights = torch.randn(2, rows, generator=gen)
    got = chunked_logprobs(logits, labels, scratch_bytes=8 * vocab * chunk)  # chunks of `chunk` rows
    (got * weights).sum().backward()
    grad, logits.grad = logits.grad, None
    ref = -F.cross_entropy(logits.float().reshape(-1, vocab), labels.reshape(-1), reduction="none").view(2, rows)
    (ref * weights).sum().backward()
    assert got.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(grad.float(), logits.grad.float(), rtol=tol, atol=tol)


def test_the_chunk_fits_its_budget_and_a_vocabulary_wider_than_it_still_runs():
    assert chunk_rows(152064) == 220 and 2 * 220 * 152064 * 4 <= 1 << 28
    assert chunk_rows(10**9, scratch_bytes=1) == 1  # one row at a time, never zero
    logits = torch.randn(3, 5)
    torch.testing.assert_close(chunked_logprobs(logits, torch.tensor([0, 4, 2]), scratch_bytes=1),
                               torch.log_softmax(logits, -1)[torch.arange(3), torch.tensor([0, 4, 2])])


def test_under_no_grad_nothing_is_saved():
    with torch.no_grad():
        out = chunked_logprobs(torch.randn(4, 7, requires_grad=True), torch.zeros(4, dtype=torch.long))
    assert out.grad_fn is None
    with pytest.raises(RuntimeError):
        out.sum().backward()
