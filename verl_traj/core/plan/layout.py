"""Batch layout: per-row trajectory / group / step structure of one training batch.

A training batch as verl holds it after rollout has ``B`` rows. Every row belongs to exactly one
trajectory (``traj_id``; without trajectory ids every row is its own trajectory with step 0) and
every trajectory to exactly one prompt group (``uid``, the GRPO group). :func:`build_layout`
derives dense indices for both, validates the step structure and counts tokens, all with vectorised
numpy / torch ops (no Python loop over rows).

Rows flagged ``is_padding`` on input (left over from an earlier plan) are not part of any
trajectory or group: they get ``traj_index == group_index == -1``, are excluded from every check
and count (but must carry no loss token: their loss would vanish), and are dropped by :func:`verl_traj.core.plan.planning.plan_mini_batches` (which adds the
padding the new plan needs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from verl_traj.core.errors import check_binary_mask
from verl_traj.core.plan.layout_rows import (BatchLayoutError, RealRows, as_flags, check_ids, check_last_steps,
                                            check_one_uid_per_trajectory, check_steps, factorize, numeric_array,
                                            required_uid, trajectories)

__all__ = ["BatchLayoutError", "BatchLayout", "build_layout", "build_layout_from_counts", "check_ids", "factorize"]


@dataclass(frozen=True)
class BatchLayout:
    """Validated structure of one batch. All tensors are CPU int64/bool of shape ``[B]`` unless stated.

    Invariants (checked by :func:`build_layout`):
      * real rows: ``traj_index`` in ``0..T-1``, ``group_index`` in ``0..G-1`` (first-appearance order),
        padding rows: both ``-1``;
      * the steps of trajectory ``t`` are exactly ``0..n_t-1`` (any row order);
      * ``is_last_step`` is True exactly on the max step of every trajectory (False on padding rows);
      * every row of a trajectory has the same group: ``group_index == traj_group[traj_index]``;
      * at least one real row.
    """

    traj_index: torch.Tensor  # [B] int64, dense 0..T-1, -1 on padding rows
    group_index: torch.Tensor  # [B] int64, dense 0..G-1, -1 on padding rows
    step_index: torch.Tensor  # [B] int64 (0 on padding rows)
    is_last_step: torch.Tensor  # [B] bool
    num_tokens: torch.Tensor  # [B] int64, attended tokens (prompt + response) = attention_mask.sum(-1)
    num_loss_tokens: torch.Tensor  # [B] int64, response_mask.sum(-1)
    is_padding: torch.Tensor  # [B] bool, rows flagged padding on input
    traj_group: torch.Tensor  # [T] int64, group of each trajectory
    traj_num_steps: torch.Tensor  # [T] int64, rows of each trajectory
    num_rows: int  # B (including input padding rows)
    num_trajectories: int  # T (real)
    num_groups: int  # G (real)

    @property
    def num_real_rows(self) -> int:
        return self.num_rows - int(self.is_padding.sum())


def _row_counts(name: str, mask: Any) -> Any:
    """Per-row counts of a ``[B, L]`` 0/1 mask (refused unless 0/1), or ``[B]`` counts as given (checked later)."""
    if not isinstance(mask, torch.Tensor):
        mask = torch.as_tensor(numeric_array(name, mask))
    if mask.dim() == 1:
        return mask.detach().cpu()
    if mask.dim() != 2:
        raise BatchLayoutError(
            f"{name} must be [B, L] (or per-row counts [B]); got shape {tuple(mask.shape)}. "
            f"Fix: pass batch.batch[{name!r}] as it is.", field=name,
        )
    check_binary_mask(name, mask, error=BatchLayoutError)
    mask = mask.detach().cpu()
    return mask.sum(-1).round().long() if mask.is_floating_point() else mask.sum(-1, dtype=torch.int64)


def build_layout(
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    uid: Sequence[Any] | np.ndarray,
    traj_id: Optional[Sequence[Any] | np.ndarray] = None,
    step_index: Optional[Sequence[int] | np.ndarray | torch.Tensor] = None,
    is_last_step: Optional[Sequence[bool] | np.ndarray | torch.Tensor] = None,
    is_padding: Optional[Sequence[bool] | np.ndarray | torch.Tensor] = None,
) -> BatchLayout:
    """Derive and validate the :class:`BatchLayout` of a batch from its masks.

    Args:
        attention_mask: ``[B, L]`` 0/1 (verl: left-padded prompt + right-padded response).
        response_mask: ``[B, R]`` 0/1 loss mask over the response.
        uid: ``[B]`` prompt-group id per row (verl's ``non_tensor_batch["uid"]``).
        traj_id, step_index, is_last_step, is_padding: as in :func:`build_layout_from_counts`.
    Raises:
        BatchLayoutError: see :func:`build_layout_from_counts`.
    """
    if attention_mask is None:
        raise BatchLayoutError("attention_mask is missing. Fix: pass batch.batch['attention_mask'] ([B, L]).",
                               field="attention_mask")
    if response_mask is None:
        raise BatchLayoutError(
            "response_mask is missing. Fix: pass batch.batch['response_mask'] ([B, R]); verl computes it "
            "with compute_response_mask(batch) before _balance_batch.", field="response_mask",
        )
    num_tokens = _row_counts("attention_mask", attention_mask)
    num_loss_tokens = _row_counts("response_mask", response_mask)
    if num_loss_tokens.shape[0] != num_tokens.shape[0]:
        raise BatchLayoutError(
            f"response_mask has {num_loss_tokens.shape[0]} rows but attention_mask has {num_tokens.shape[0]}. "
            "Fix: both must come from the same batch (same row order).", field="response_mask",
        )
    return _build(num_tokens, num_loss_tokens, ("attention_mask.sum(-1)", "response_mask.sum(-1)"), uid, traj_id,
                  step_index, is_last_step, is_padding)


def build_layout_from_counts(
    num_tokens: torch.Tensor | np.ndarray,
    num_loss_tokens: torch.Tensor | np.ndarray,
    uid: Sequence[Any] | np.ndarray,
    traj_id: Optional[Sequence[Any] | np.ndarray] = None,
    step_index: Optional[Sequence[int] | np.ndarray | torch.Tensor] = None,
    is_last_step: Optional[Sequence[bool] | np.ndarray | torch.Tensor] = None,
    is_padding: Optional[Sequence[bool] | np.ndarray | torch.Tensor] = None,
) -> BatchLayout:
    """:func:`build_layout` from per-row token counts ``[B]`` instead of masks.

    Args:
        num_tokens: ``[B]`` attended tokens (prompt + response) per row.
        num_loss_tokens: ``[B]`` loss tokens per row.
        uid: ``[B]`` prompt-group id per row.
        traj_id: ``[B]`` trajectory id per row (step-wise data); requires ``step_index``.
        step_index: ``[B]`` int step of the row within its trajectory; requires ``traj_id``.
        is_last_step: ``[B]`` bool, optional; derived as ``step == max step`` when absent.
        is_padding: ``[B]`` bool, optional; rows already flagged padding.
    Raises:
        BatchLayoutError: missing uid, mismatched lengths, ``traj_id`` without ``step_index`` (or
            vice versa), a trajectory whose rows carry two uids, duplicate / missing / negative steps,
            a trajectory with zero or several last steps or a last step that is not its max step,
            a batch without any real row; token counts that are not whole numbers >= 0 (NaN, inf,
            fractional, negative), a real row with no attended token or with more loss tokens than
            tokens, a row flagged padding that carries loss tokens (it would be dropped with its loss);
            ``None`` / NaN ids or ids that mix str with other types; ``is_padding`` / ``is_last_step`` other
            than bools or 0/1; arrays that are ragged, of strings or of complex numbers.
    """
    return _build(num_tokens, num_loss_tokens, ("num_tokens", "num_loss_tokens"), uid, traj_id, step_index,
                  is_last_step, is_padding)


def _build(num_tokens: Any, num_loss_tokens: Any, count_names: tuple[str, str], uid: Any, traj_id: Any = None,
           step_index: Any = None, is_last_step: Any = None, is_padding: Any = None) -> BatchLayout:
    num_tokens, num_loss_tokens = _row_count_pair(num_tokens, num_loss_tokens, count_names)
    n = int(num_tokens.shape[0])
    uid_arr = required_uid(uid, n)
    pad = np.zeros(n, dtype=bool) if is_padding is None else as_flags("is_padding", is_padding, n)
    real = RealRows(pad)
    _check_real_counts(num_tokens, num_loss_tokens, count_names, real)
    _check_padding_has_no_loss(num_loss_tokens, count_names[1], real)
    real_uid = real.take(uid_arr)
    check_ids("uid", real_uid, real.index)
    groups = factorize(real_uid, "uid")[0]
    ids = trajectories(traj_id, step_index, real)
    traj_group = groups[ids.first]
    check_one_uid_per_trajectory(ids, groups, traj_group, real_uid)
    counts = np.bincount(ids.codes, minlength=ids.num).astype(np.int64)
    if traj_id is not None:
        check_steps(ids, counts)
    derived_last = ids.steps == (counts[ids.codes] - 1)
    if is_last_step is not None:
        given_last = real.take(as_flags("is_last_step", is_last_step, n))
        check_last_steps(ids, given_last, derived_last)
    return BatchLayout(
        traj_index=torch.from_numpy(real.scatter(ids.codes, -1, np.int64)),
        group_index=torch.from_numpy(real.scatter(groups, -1, np.int64)),
        step_index=torch.from_numpy(real.scatter(ids.steps, 0, np.int64)),
        is_last_step=torch.from_numpy(real.scatter(derived_last, False, bool)),
        num_tokens=num_tokens,
        num_loss_tokens=num_loss_tokens,
        is_padding=torch.from_numpy(pad.copy()),
        traj_group=torch.from_numpy(traj_group.astype(np.int64)),
        traj_num_steps=torch.from_numpy(counts),
        num_rows=n,
        num_trajectories=ids.num,
        num_groups=int(groups.max()) + 1,
    )


def _checked_counts(name: str, value: Any) -> torch.Tensor:
    """``[B]`` per-row token counts as CPU int64; NaN, inf, fractional and negative counts are refused."""
    t = value.detach().cpu() if isinstance(value, torch.Tensor) else torch.as_tensor(numeric_array(name, value))
    t = t.reshape(-1)
    fix = (f"{name} counts tokens per row: whole numbers >= 0 (attention_mask.sum(-1) / response_mask.sum(-1)); "
           "fix the producer of the counts")
    if t.is_floating_point():
        whole = torch.isfinite(t) & (t == torch.round(t))
        if not bool(whole.all()):
            r = int(torch.nonzero(~whole)[0, 0])
            raise BatchLayoutError.invalid(f"{name}[{r}]", float(t[r]), "is not a whole, finite number of tokens", fix)
    elif t.is_complex():
        raise BatchLayoutError.invalid(name, t, "is complex", fix)
    t = t.long()
    if t.numel() and int(t.min()) < 0:
        r = int(torch.argmin(t))
        raise BatchLayoutError.invalid(f"{name}[{r}]", int(t[r]), "is negative", fix)
    return t


def _row_count_pair(num_tokens: Any, num_loss_tokens: Any,
                    names: tuple[str, str] = ("num_tokens", "num_loss_tokens")) -> tuple[torch.Tensor, torch.Tensor]:
    """Both per-row counts as CPU int64 ``[B]`` tensors of the same length (values checked)."""
    a, b = _checked_counts(names[0], num_tokens), _checked_counts(names[1], num_loss_tokens)
    if b.shape[0] != a.shape[0]:
        raise BatchLayoutError(
            f"{names[1]} has {b.shape[0]} rows but {names[0]} has {a.shape[0]}. Fix: same batch, same order.",
            field=names[1],
        )
    return a, b


def _check_padding_has_no_loss(num_loss_tokens: torch.Tensor, name: str, real: "RealRows") -> None:
    """A row flagged padding carries no loss token (the plan drops input padding: its loss would vanish)."""
    if real.index is None:
        return
    bad = np.flatnonzero(real.pad & (num_loss_tokens.numpy() > 0))
    if bad.size:
        r = int(bad[0])
        raise BatchLayoutError.invalid(
            f"is_padding[{r}]", True, f"flags a row with {name}[{r}]={int(num_loss_tokens[r])} loss tokens "
            "(a padding row's loss would be dropped silently)",
            "flag only rows without loss tokens as padding (zero their response_mask), or set is_padding=False",
        )


def _check_real_counts(num_tokens: torch.Tensor, num_loss_tokens: torch.Tensor, names: tuple[str, str],
                       real: "RealRows") -> None:
    """Every real row attends at least one token and has at most as many loss tokens as tokens."""
    tok, loss = num_tokens.numpy(), num_loss_tokens.numpy()
    bad = (tok <= 0) | (loss > tok)
    if real.index is not None:
        bad &= ~real.pad
    if not bad.any():
        return
    r = int(np.flatnonzero(bad)[0])
    if tok[r] <= 0:
        raise BatchLayoutError.invalid(
            f"{names[0]}[{r}]", int(tok[r]), "is 0: a real row with no attended token (an empty rollout)",
            "drop empty rows upstream (the rollout returned no token) or flag them is_padding=True",
        )
    raise BatchLayoutError.invalid(
        f"{names[1]}[{r}]", int(loss[r]), f"exceeds {names[0]}[{r}]={int(tok[r])}: a row cannot have more loss tokens "
        "than attended tokens",
        "response_mask must be 0 wherever the response's attention_mask is 0 (verl's compute_response_mask), and "
        "both counts must come from the same rows in the same order",
    )
