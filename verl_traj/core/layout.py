"""Batch layout: per-row trajectory / group / step structure of one training batch.

A training batch as verl holds it after rollout has ``B`` rows. Every row belongs to exactly one
trajectory (``traj_id``; without trajectory ids every row is its own trajectory with step 0) and
every trajectory to exactly one prompt group (``uid``, the GRPO group). :func:`build_layout`
derives dense indices for both, validates the step structure and counts tokens, all with vectorised
numpy / torch ops (no Python loop over rows).

Rows flagged ``is_padding`` on input (left over from an earlier plan) are not part of any
trajectory or group: they get ``traj_index == group_index == -1``, are excluded from every check
and count, and are dropped by :func:`verl_traj.core.planning.plan_mini_batches` (which adds the
padding the new plan needs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

__all__ = ["BatchLayoutError", "BatchLayout", "build_layout", "build_layout_from_counts", "factorize"]


class BatchLayoutError(ValueError):
    """Invalid batch structure. The message names the field, the offending value and the fix."""


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


def factorize(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dense codes in first-appearance order.

    Args:
        values: 1-D array (numeric, or object array of hashable str/int).
    Returns:
        ``(codes [N] int64 in 0..K-1, first [K] int64)`` with ``values[first[k]]`` the k-th distinct
        value in order of first appearance and ``values == values[first][codes]``.
    """
    values = np.asarray(values)
    if values.shape[0] == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    if values.dtype == object:
        # ids are compared by their str() form: fixed-width unicode sorts ~3x faster than objects
        try:
            values = values.astype(str)
        except (TypeError, ValueError):
            pass
    try:
        _, first, inverse = np.unique(values, return_index=True, return_inverse=True)
    except TypeError as exc:  # mixed incomparable objects
        raise BatchLayoutError(f"ids must be mutually comparable (all str or all int); got {exc}") from exc
    inverse = inverse.reshape(-1)
    rank = np.empty(first.shape[0], dtype=np.int64)
    by_first = np.argsort(first, kind="stable")
    rank[by_first] = np.arange(first.shape[0], dtype=np.int64)
    return rank[inverse], first[by_first].astype(np.int64)


def _as_1d(name: str, value: Any, n: Optional[int]) -> np.ndarray:
    arr = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    if arr.ndim != 1:
        raise BatchLayoutError(
            f"{name} must be 1-D with one entry per row; got shape {tuple(arr.shape)}. "
            f"Fix: pass {name} as a numpy array of length B."
        )
    if n is not None and arr.shape[0] != n:
        raise BatchLayoutError(
            f"{name} has {arr.shape[0]} entries but the batch has {n} rows (attention_mask.shape[0]). "
            f"Fix: {name} must carry exactly one entry per row, in row order."
        )
    return arr


def _row_counts(name: str, mask: Any) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor):
        mask = torch.as_tensor(np.asarray(mask))
    if mask.dim() == 1:
        return mask.detach().cpu().long()
    if mask.dim() != 2:
        raise BatchLayoutError(f"{name} must be [B, L] (or per-row counts [B]); got shape {tuple(mask.shape)}.")
    return mask.detach().cpu().long().sum(-1)


def build_layout(
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    uid: Sequence[Any] | np.ndarray,
    traj_id: Optional[Sequence[Any] | np.ndarray] = None,
    step_index: Optional[Sequence[int] | np.ndarray | torch.Tensor] = None,
    is_last_step: Optional[Sequence[bool] | np.ndarray | torch.Tensor] = None,
    is_padding: Optional[Sequence[bool] | np.ndarray | torch.Tensor] = None,
) -> BatchLayout:
    """Derive and validate the :class:`BatchLayout` of a batch.

    Args:
        attention_mask: ``[B, L]`` 0/1 (verl: left-padded prompt + right-padded response).
        response_mask: ``[B, R]`` 0/1 loss mask over the response.
        uid: ``[B]`` prompt-group id per row (verl's ``non_tensor_batch["uid"]``).
        traj_id: ``[B]`` trajectory id per row (step-wise data); requires ``step_index``.
        step_index: ``[B]`` int step of the row within its trajectory; requires ``traj_id``.
        is_last_step: ``[B]`` bool, optional; derived as ``step == max step`` when absent.
        is_padding: ``[B]`` bool, optional; rows already flagged padding.
    Raises:
        BatchLayoutError: see :func:`build_layout_from_counts`.
    """
    if attention_mask is None:
        raise BatchLayoutError("attention_mask is missing. Fix: pass batch.batch['attention_mask'] ([B, L]).")
    if response_mask is None:
        raise BatchLayoutError(
            "response_mask is missing. Fix: pass batch.batch['response_mask'] ([B, R]); verl computes it "
            "with compute_response_mask(batch) before _balance_batch."
        )
    num_tokens = _row_counts("attention_mask", attention_mask)
    num_loss_tokens = _row_counts("response_mask", response_mask)
    if num_loss_tokens.shape[0] != num_tokens.shape[0]:
        raise BatchLayoutError(
            f"response_mask has {num_loss_tokens.shape[0]} rows but attention_mask has {num_tokens.shape[0]}. "
            "Fix: both must come from the same batch (same row order)."
        )
    return build_layout_from_counts(num_tokens, num_loss_tokens, uid, traj_id, step_index, is_last_step, is_padding)


def build_layout_from_counts(
    num_tokens: torch.Tensor | np.ndarray,
    num_loss_tokens: torch.Tensor | np.ndarray,
    uid: Sequence[Any] | np.ndarray,
    traj_id: Optional[Sequence[Any] | np.ndarray] = None,
    step_index: Optional[Sequence[int] | np.ndarray | torch.Tensor] = None,
    is_last_step: Optional[Sequence[bool] | np.ndarray | torch.Tensor] = None,
    is_padding: Optional[Sequence[bool] | np.ndarray | torch.Tensor] = None,
) -> BatchLayout:
    """Same as :func:`build_layout` but from per-row token counts ``[B]`` instead of masks.

    Raises:
        BatchLayoutError: missing uid, mismatched lengths, ``traj_id`` without ``step_index`` (or
            vice versa), a trajectory whose rows carry two uids, duplicate / missing / negative steps,
            a trajectory with zero or several last steps or a last step that is not its max step,
            a batch without any real row.
    """
    num_tokens = torch.as_tensor(np.asarray(num_tokens) if not isinstance(num_tokens, torch.Tensor) else num_tokens)
    num_tokens = num_tokens.detach().cpu().long().reshape(-1)
    num_loss_tokens = torch.as_tensor(
        np.asarray(num_loss_tokens) if not isinstance(num_loss_tokens, torch.Tensor) else num_loss_tokens
    )
    num_loss_tokens = num_loss_tokens.detach().cpu().long().reshape(-1)
    n = int(num_tokens.shape[0])
    if num_loss_tokens.shape[0] != n:
        raise BatchLayoutError(
            f"num_loss_tokens has {num_loss_tokens.shape[0]} rows but num_tokens has {n}. Fix: same batch, same order."
        )
    if uid is None:
        raise BatchLayoutError(
            "uid is missing. Fix: every row needs its prompt-group id in non_tensor_batch['uid'] "
            "(verl's fit() assigns one uuid per prompt before repeat(n))."
        )
    uid_arr = _as_1d("uid", uid, n)
    if (traj_id is None) != (step_index is None):
        given, missing = ("traj_id", "step_index") if step_index is None else ("step_index", "traj_id")
        raise BatchLayoutError(
            f"{given} was given without {missing}. Fix: step-wise rows need both a trajectory id and a step "
            f"index per row (non_tensor_batch['traj_id'], ['step_index']); pass neither for one row per trajectory."
        )

    pad_np = np.zeros(n, dtype=bool) if is_padding is None else _as_1d("is_padding", is_padding, n).astype(bool)
    real = ~pad_np
    num_real = int(real.sum())
    if num_real == 0:
        raise BatchLayoutError(
            f"the batch has no real row ({n} rows, all flagged is_padding). This is an upstream bug "
            "(rollout produced nothing or every row was masked): fix the producer; refusing to plan an empty batch."
        )
    real_idx = np.flatnonzero(real) if num_real < n else None

    def _real(arr: np.ndarray) -> np.ndarray:
        return arr if real_idx is None else arr[real_idx]

    # groups
    g_codes, _ = factorize(_real(uid_arr))
    num_groups = int(g_codes.max()) + 1

    # trajectories + steps
    if traj_id is None:
        t_codes = np.arange(num_real, dtype=np.int64)
        steps = np.zeros(num_real, dtype=np.int64)
        t_first = t_codes
        traj_id_arr = None
    else:
        traj_id_arr = _as_1d("traj_id", traj_id, n)
        step_arr = _as_1d("step_index", step_index, n)
        if step_arr.dtype.kind not in "iub":
            if step_arr.dtype.kind == "f" and np.all(np.mod(step_arr, 1) == 0):
                step_arr = step_arr.astype(np.int64)
            else:
                try:
                    step_arr = step_arr.astype(np.int64)
                except (TypeError, ValueError) as exc:
                    raise BatchLayoutError(
                        f"step_index must be integers; got dtype {step_arr.dtype}. Fix: pass int step numbers."
                    ) from exc
        t_codes, t_first = factorize(_real(traj_id_arr))
        steps = _real(step_arr).astype(np.int64)
    num_traj = int(t_codes.max()) + 1
    traj_group = g_codes[t_first]

    def _tid(t: int) -> Any:
        return _real(traj_id_arr)[t_first[t]] if traj_id_arr is not None else f"row {int(_real(np.arange(n))[t])}"

    # one uid per trajectory
    bad = np.flatnonzero(g_codes != traj_group[t_codes])
    if bad.size:
        r = int(bad[0])
        t = int(t_codes[r])
        uids = np.unique(_real(uid_arr)[t_codes == t].astype(str)).tolist()
        raise BatchLayoutError(
            f"trajectory traj_id={_tid(t)!r} has rows with {len(uids)} different uids {uids[:4]}. "
            "Fix: all steps of one trajectory must carry the uid of its prompt group (set uid per prompt, "
            "then copy it to every step row of the trajectory)."
        )

    counts = np.bincount(t_codes, minlength=num_traj).astype(np.int64)
    if traj_id_arr is not None:
        if steps.size and steps.min() < 0:
            r = int(np.argmin(steps))
            raise BatchLayoutError(
                f"step_index={int(steps[r])} is negative (traj_id={_tid(int(t_codes[r]))!r}). "
                "Fix: steps of a trajectory must be numbered 0..n-1."
            )
        too_big = np.flatnonzero(steps >= counts[t_codes])
        start = np.cumsum(counts) - counts
        slot = start[t_codes] + np.minimum(steps, counts[t_codes] - 1)
        hits = np.bincount(slot, minlength=num_real)
        if too_big.size or np.any(hits != 1):
            if too_big.size:
                t = int(t_codes[too_big[0]])
            else:
                t = int(np.searchsorted(start, int(np.flatnonzero(hits != 1)[0]), side="right") - 1)
            got = np.sort(steps[t_codes == t])
            dup = got[1:][got[1:] == got[:-1]]
            missing = np.setdiff1d(np.arange(counts[t]), got)
            raise BatchLayoutError(
                f"trajectory traj_id={_tid(t)!r} has steps {got[:12].tolist()}{'...' if got.size > 12 else ''}: "
                f"duplicate steps {np.unique(dup)[:8].tolist()}, missing steps {missing[:8].tolist()} "
                f"(expected exactly 0..{counts[t] - 1} for its {counts[t]} rows). Fix: every step of a "
                "trajectory must be in the same batch exactly once (do not drop or duplicate step rows)."
            )
    derived_last = steps == (counts[t_codes] - 1)
    if is_last_step is not None:
        last_np = _real(_as_1d("is_last_step", is_last_step, n)).astype(bool)
        per_traj = np.bincount(t_codes, weights=last_np, minlength=num_traj)
        wrong_count = np.flatnonzero(per_traj != 1)
        if wrong_count.size:
            t = int(wrong_count[0])
            raise BatchLayoutError(
                f"trajectory traj_id={_tid(t)!r} has {int(per_traj[t])} rows with is_last_step=True "
                "(expected exactly 1). Fix: flag exactly the final step of every trajectory; a trajectory "
                "without its last step was truncated upstream (keep all of its steps in the batch)."
            )
        mism = np.flatnonzero(last_np != derived_last)
        if mism.size:
            t = int(t_codes[mism[0]])
            raise BatchLayoutError(
                f"trajectory traj_id={_tid(t)!r}: is_last_step=True is on step {int(steps[last_np & (t_codes == t)][0])}"
                f" but its max step is {int(counts[t]) - 1}. Fix: the last step must be the highest step_index."
            )

    def _full(real_vals: np.ndarray, fill: Any, dtype: Any) -> np.ndarray:
        if real_idx is None:
            return real_vals.astype(dtype, copy=False)
        out = np.full(n, fill, dtype=dtype)
        out[real_idx] = real_vals
        return out

    return BatchLayout(
        traj_index=torch.from_numpy(_full(t_codes, -1, np.int64)),
        group_index=torch.from_numpy(_full(g_codes, -1, np.int64)),
        step_index=torch.from_numpy(_full(steps, 0, np.int64)),
        is_last_step=torch.from_numpy(_full(derived_last, False, bool)),
        num_tokens=num_tokens,
        num_loss_tokens=num_loss_tokens,
        is_padding=torch.from_numpy(pad_np.copy()),
        traj_group=torch.from_numpy(traj_group.astype(np.int64)),
        traj_num_steps=torch.from_numpy(counts),
        num_rows=n,
        num_trajectories=num_traj,
        num_groups=num_groups,
    )
