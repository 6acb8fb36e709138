"""Supervised warm start of a small causal LM on generated examples (offline, CPU).

Used by ``build_tiny.build_tool_caller`` (a tiny model that calls the ``digits`` tool, for the
multi-turn tests) and by the calculator recipe's ``prepare.py``: a random tiny model never emits a
parseable tool call, and nothing can be downloaded, so each teaches the format with a few hundred
steps of next-token loss on the assistant's tokens only.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import torch

Example = tuple[Sequence[int], Sequence[int]]  # (token ids, labels with -100 where no loss)


def pad_examples(examples: Sequence[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad ``(ids, labels)`` pairs to ``[N, W]`` input_ids, attention_mask and labels (-100 on padding)."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (ids, lab) in enumerate(examples):
        if len(ids) != len(lab):
            raise ValueError(f"example {row}: {len(ids)} token ids but {len(lab)} labels; they must align")
        input_ids[row, : len(ids)] = torch.as_tensor(ids)
        labels[row, : len(lab)] = torch.as_tensor(lab)
        attention_mask[row, : len(ids)] = 1
    return input_ids, attention_mask, labels


def supervised_warm_start(
    model: torch.nn.Module,
    make_example: Callable[[], Example],
    *,
    steps: int,
    lr: float,
    pad_id: int,
    batch_size: int = 8,
    warmup_steps: int = 0,
    decay: bool = False,
    clip_grad: Optional[float] = None,
    log_every: int = 0,
) -> list[float]:
    """Train ``model`` (a Hugging Face causal LM) in place for ``steps`` AdamW steps; return the losses.

    ``make_example()`` returns one fresh ``(ids, labels)`` example. The learning rate warms up
    linearly over ``warmup_steps`` and, with ``decay``, falls linearly to 5% of ``lr``.
    """

    def schedule(step: int) -> float:
        warm = min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0
        return warm * (max(0.05, 1 - step / steps) if decay else 1.0)

    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, schedule)
    model.train()
    losses, t0 = [], time.time()
    for step in range(steps):
        input_ids, attention_mask, labels = pad_examples([make_example() for _ in range(batch_size)], pad_id)
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        optim.zero_grad()
        loss.backward()
        if clip_grad is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
        optim.step()
        sched.step()
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"[warm start] step {step:4d} loss {losses[-1]:.3f} ({time.time() - t0:.0f}s)", flush=True)
    model.eval()
    return losses
