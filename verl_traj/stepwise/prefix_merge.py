"""Prefix merging of step-wise rows: O(T^2) -> O(T) training tokens for multi-turn trajectories.

Step i of a trajectory is the pair (prompt_i, response_i). When ``prompt_i + response_i`` is a token
prefix of ``prompt_{i+1}``, step i+1's row re-encodes everything step i's row already holds; the two
become ONE row: ``prompt_i`` followed by ``response_i``, then the observation tokens
``prompt_{i+1}[len(prompt_i + response_i):]`` (loss mask 0), then ``response_{i+1}``, and so on while
the chain holds. When it breaks (context rewritten or truncated, or the previous response was
re-tokenised differently inside the next prompt) a new row starts: a trajectory can become several
rows (partial merge).

Invariants (tested): every loss token of the input appears exactly once in the output with the
same token id, the same per-token values (log-probs, ...) and in the same order; observation tokens
get loss mask 0 and per-token values 0; prompts of merged rows are the first merged step's prompt.

Pure module: torch only. Works on lists of 1-D token tensors (variable length, no padding). Each
boundary is decided by one ``torch.equal`` on slices; rows are assembled with one ``torch.cat``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import torch

from verl_traj.core.errors import TrajInputError, check_binary_mask

__all__ = [
    "MergedRow",
    "MergeStats",
    "PrefixMergeError",
    "RowBuilder",
    "can_merge_boundaries",
    "extends_context",
    "merge_trajectory_steps",
]


class PrefixMergeError(TrajInputError):
    """Inputs to prefix merging are inconsistent; the message names the step and the field."""


@dataclass
class MergedRow:
    """One training row after merging.

    Attributes:
        prompt_ids: LongTensor [P]: the first merged step's prompt (no loss).
        response_ids: LongTensor [Q]: response_0, obs_1, response_1, ... (everything after the prompt).
        response_mask: tensor [Q] (dtype of the input masks): 1 on LLM tokens, 0 on observations.
        per_token: name -> tensor [Q] (e.g. ``"rollout_log_probs"``), 0 on observation tokens.
        source_steps: original step positions (0-based, in the input order) merged into this row.
        step_index: index of this row among the trajectory's merged rows (0..).
        is_last_step: this row holds the trajectory's last step.
    """

    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    per_token: dict[str, torch.Tensor] = field(default_factory=dict)
    source_steps: list[int] = field(default_factory=list)
    step_index: int = 0
    is_last_step: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.prompt_ids.numel() + self.response_ids.numel())


@dataclass
class MergeStats:
    """Row and token accounting before/after merging (sums over trajectories with ``+``)."""

    rows_before: int = 0
    rows_after: int = 0
    tokens_before: int = 0
    tokens_after: int = 0
    loss_tokens_before: int = 0
    loss_tokens_after: int = 0

    def __add__(self, other: "MergeStats") -> "MergeStats":
        return MergeStats(
            *(getattr(self, f) + getattr(other, f) for f in self.__dataclass_fields__)  # type: ignore[arg-type]
        )

    @property
    def token_ratio(self) -> float:
        return self.tokens_before / self.tokens_after if self.tokens_after else 1.0

    def metrics(self, prefix: str = "traj_merge") -> dict[str, float]:
        return {
            f"{prefix}/rows_before": float(self.rows_before),
            f"{prefix}/rows_after": float(self.rows_after),
            f"{prefix}/tokens_before": float(self.tokens_before),
            f"{prefix}/tokens_after": float(self.tokens_after),
            f"{prefix}/loss_tokens": float(self.loss_tokens_after),
            f"{prefix}/token_ratio": float(self.token_ratio),
        }


class RowBuilder:
    """The one assembler of merged rows (used here and by the delta-encoded path of
    :mod:`verl_traj.stepwise.expand`): a row is its first step's prompt, then response segments (with their
    mask and per-token values) and observation segments (mask 0, per-token values 0), concatenated once."""

    def __init__(self, prompt: torch.Tensor, start: int, per_token_names: Sequence[str] = ()):
        self.prompt, self.start = prompt, start
        self.ids: list[torch.Tensor] = []
        self.masks: list[torch.Tensor] = []
        self.values: dict[str, list[torch.Tensor]] = {k: [] for k in per_token_names}
        self.num_tokens = int(prompt.numel())  # tokens of the row so far

    def add_response(self, ids: torch.Tensor, mask: torch.Tensor, values: Mapping[str, torch.Tensor]) -> None:
        self.num_tokens += int(ids.numel())
        self.ids.append(ids)
        self.masks.append(mask)
        for k in self.values:
            self.values[k].append(values[k])

    def add_observation(self, tail: torch.Tensor, like_mask: torch.Tensor, like: Mapping[str, torch.Tensor]) -> None:
        """``tail`` (context the next call saw after this row's tokens): mask 0 and values 0, in the dtypes
        and devices of ``like_mask`` / ``like`` (the next response's)."""
        if tail.numel():
            zeros = {k: torch.zeros(tail.numel(), dtype=like[k].dtype, device=like[k].device) for k in self.values}
            self.add_response(tail, torch.zeros(tail.numel(), dtype=like_mask.dtype, device=like_mask.device), zeros)

    def full_context(self) -> torch.Tensor:
        return torch.cat([self.prompt] + self.ids)

    def close(self, end: int, step_index: int, is_last: bool) -> MergedRow:
        """The row of steps ``start..end`` (inclusive)."""
        def cat(parts: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat(parts) if len(parts) > 1 else parts[0]

        return MergedRow(prompt_ids=self.prompt, response_ids=cat(self.ids), response_mask=cat(self.masks),
                         per_token={k: cat(v) for k, v in self.values.items()},
                         source_steps=list(range(self.start, end + 1)), step_index=step_index, is_last_step=is_last)


def extends_context(prefix_a: torch.Tensor, prefix_b: torch.Tensor, seq: torch.Tensor) -> bool:
    """``cat(prefix_a, prefix_b)`` is a prefix of ``seq`` (two slice comparisons, no concatenation)."""
    na, nb = prefix_a.numel(), prefix_b.numel()
    if na + nb > seq.numel():
        return False
    return torch.equal(seq[:na], prefix_a) and torch.equal(seq[na : na + nb], prefix_b)


def can_merge_boundaries(prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor]) -> list[bool]:
    """``out[i]`` = step i can be merged into step i+1 (``prompt_i + response_i`` prefixes ``prompt_{i+1}``).

    Because a merged row up to step i is exactly ``prompt_i + response_i`` when the chain holds,
    this pairwise test decides every chain.
    """
    return [extends_context(prompts[i], responses[i], prompts[i + 1]) for i in range(len(prompts) - 1)]


def merge_trajectory_steps(
    prompts: Sequence[torch.Tensor],
    responses: Sequence[torch.Tensor],
    response_masks: Optional[Sequence[torch.Tensor]] = None,
    per_token: Optional[Mapping[str, Sequence[torch.Tensor]]] = None,
    *,
    enable: bool = True,
) -> tuple[list[MergedRow], MergeStats]:
    """Merge the consecutive steps of ONE trajectory whose context is a token prefix of the next.

    Args:
        prompts: per step, 1-D LongTensor of prompt token ids (the context that LLM call saw).
        responses: per step, 1-D LongTensor of response token ids.
        response_masks: per step, 1-D mask over the response (default all ones). Loss tokens are
            where it is non-zero.
        per_token: name -> per step 1-D tensors aligned with the response (e.g. rollout log-probs).
        enable: ``False`` returns one row per step (same output format, no merging).

    Returns:
        ``(rows, stats)``; rows in step order.
    """
    for name, value in (("prompts", prompts), ("responses", responses), ("response_masks", response_masks)):
        if value is not None and (isinstance(value, (str, bytes, torch.Tensor)) or not hasattr(value, "__len__")):
            raise PrefixMergeError.invalid(name, value, "is not a sequence of per-step tensors",
                                           "pass a list of 1-D tensors, one per step")
    if per_token is not None and not isinstance(per_token, Mapping):
        raise PrefixMergeError.invalid("per_token", per_token, "is not a mapping", "pass {name: [tensor per step]}")
    n = len(prompts)
    if response_masks is None:
        response_masks = [torch.ones(r.numel() if isinstance(r, torch.Tensor) else 0, dtype=torch.long)
                          for r in responses]
    per_token = dict(per_token or {})
    _check_steps(prompts, responses, response_masks, per_token)
    stats = MergeStats(rows_before=n)
    stats.tokens_before = sum(int(p.numel() + r.numel()) for p, r in zip(prompts, responses))
    stats.loss_tokens_before = sum(int(torch.count_nonzero(m)) for m in response_masks)
    if n == 0:
        return [], stats

    merge_next = can_merge_boundaries(prompts, responses) if enable else [False] * (n - 1)

    rows: list[MergedRow] = []
    start = 0
    for i in range(n):
        if i < n - 1 and merge_next[i]:
            continue
        rows.append(_assemble(prompts, responses, response_masks, per_token, start, i, len(rows), i == n - 1))
        start = i + 1

    stats.rows_after = len(rows)
    stats.tokens_after = sum(r.num_tokens for r in rows)
    stats.loss_tokens_after = sum(int(torch.count_nonzero(r.response_mask)) for r in rows)
    return rows, stats


def _check_steps(prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor],
                 masks: Sequence[torch.Tensor], per_token: Mapping[str, Sequence[torch.Tensor]]) -> None:
    """One prompt, response and mask (and per-token value) per step; 1-D tensors; masks 0/1 and aligned with the
    responses (every refusal a :class:`PrefixMergeError` naming the field)."""
    n = len(prompts)
    for name, values in (("responses", responses), ("response_masks", masks),
                         *((f"per_token[{k!r}]", v) for k, v in per_token.items())):
        if not hasattr(values, "__len__") or len(values) != n:
            raise PrefixMergeError.invalid(name, values, f"does not have one entry per step ({n} prompts)",
                                           "pass one entry per step")
    for i in range(n):
        for name, t in (("prompts", prompts[i]), ("responses", responses[i]), ("response_masks", masks[i])):
            if not isinstance(t, torch.Tensor) or t.dim() != 1:
                raise PrefixMergeError.invalid(f"{name}[{i}]", t, "is not a 1-D tensor",
                                               "pass unpadded 1-D token tensors, one per step")
        for name, t in (("prompts", prompts[i]), ("responses", responses[i])):
            if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                raise PrefixMergeError.invalid(f"{name}[{i}]", t, f"has dtype {t.dtype}", "pass int64 token ids")
        check_binary_mask(f"response_masks[{i}]", masks[i], error=PrefixMergeError)
        for name, t in (("response_masks", masks[i]), *((f"per_token[{k!r}]", v[i]) for k, v in per_token.items())):
            if not isinstance(t, torch.Tensor) or t.numel() != responses[i].numel():
                raise PrefixMergeError.invalid(f"{name}[{i}]", t, f"does not have the response's "
                                               f"{responses[i].numel()} entries", "align it with the response tokens")


def _assemble(prompts, responses, masks, per_token, start: int, end: int, step_index: int, is_last: bool) -> MergedRow:
    """Build the row for steps ``start..end`` (inclusive), whose chain is known to hold."""
    row = RowBuilder(prompts[start], start, list(per_token))
    for j in range(start, end + 1):
        values = {k: v[j] for k, v in per_token.items()}
        if j > start:
            row.add_observation(prompts[j][row.num_tokens:], masks[j], values)
        row.add_response(responses[j], masks[j], values)
    return row.close(end, step_index, is_last)
