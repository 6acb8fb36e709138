"""Log-probabilities of the labels from ``[N, V]`` logits with bounded scratch memory: the fp32 log-softmax is
computed a chunk of rows at a time, forward and backward, so the peak scratch is two fp32 chunk x ``V`` buffers (the
chunk in fp32 and its softmax; :data:`LOGPROB_SCRATCH_BYTES` in all) plus ``[N]`` fp32 per-row statistics, never
``N x V`` in fp32. ``scripts/bench_logprobs.py`` measures it against verl's fallback.

Where it runs: verl's engine log-probs in a process without flash-attn's fused cross-entropy
(:mod:`verl_traj.cpu.torch_flash`, the ``torch_varlen`` path). verl's own fallback there loops over the rows in Python
(one kernel launch per token of a packed micro-batch); a single ``cross_entropy`` over all rows is fast but keeps an
fp32 ``[N, V]`` log-softmax for the backward: at 32K tokens and a 152K vocabulary that is 19.5 GB of scratch.

The numbers are fp32 ``logit[label] - logsumexp(logits)`` (the same as ``cross_entropy`` / verl's fp32 path, within fp32
rounding); the backward recomputes each chunk's softmax from the saved logits and the ``[N]`` logsumexp.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["LOGPROB_SCRATCH_BYTES", "chunk_rows", "chunked_logprobs"]

LOGPROB_SCRATCH_BYTES = 1 << 28  # 256 MiB of fp32 scratch in all: chunks of 220 rows of a 152K vocabulary


def chunk_rows(vocab: int, scratch_bytes: int = LOGPROB_SCRATCH_BYTES) -> int:
    """Rows per chunk so that two fp32 ``[rows, vocab]`` buffers fit ``scratch_bytes`` (at least 1 row)."""
    return max(1, int(scratch_bytes) // (8 * int(vocab)))


class _ChunkedLogprobs(torch.autograd.Function):
    """``[N, V]`` logits, ``[N]`` labels -> ``[N]`` fp32 log-probs; saves the logits (no copy) and ``[N]`` logsumexp."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, rows: int) -> torch.Tensor:
        n = logits.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        for start in range(0, n, rows):  # one chunk of rows at a time: bounded fp32 scratch
            chunk, end = logits[start:start + rows].float(), min(n, start + rows)
            lse[start:end] = torch.logsumexp(chunk, dim=-1)
            out[start:end] = chunk.gather(-1, labels[start:end, None]).squeeze(-1) - lse[start:end]
        ctx.save_for_backward(logits, labels, lse)
        ctx.rows = rows
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, labels, lse = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.rows):  # d/dx (x_label - lse) = onehot - softmax
            end = min(logits.shape[0], start + ctx.rows)
            g = grad[start:end, None].float()
            chunk = torch.exp(logits[start:end].float() - lse[start:end, None]).mul_(-g)
            chunk.scatter_add_(-1, labels[start:end, None], g)
            grad_logits[start:end] = chunk.to(logits.dtype)
        return grad_logits, None, None


def chunked_logprobs(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True,
                     scratch_bytes: int = LOGPROB_SCRATCH_BYTES) -> torch.Tensor:
    """``[..., V]`` logits, ``[...]`` int labels -> ``[...]`` fp32 log-probs of the labels (verl's
    ``logprobs_from_logits`` signature; ``inplace_backward`` is flash-attn's and has no meaning here). Peak scratch:
    two fp32 buffers of :func:`chunk_rows` rows x ``V`` (``scratch_bytes``)."""
    vocab = logits.shape[-1]
    flat = _ChunkedLogprobs.apply(logits.reshape(-1, vocab), labels.reshape(-1), chunk_rows(vocab, scratch_bytes))
    return flat.view(labels.shape)
