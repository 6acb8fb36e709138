"""Checks of the step-row advantage inputs, where they enter (:mod:`verl_traj.stepwise.advantages`).

Every refusal is a :class:`StepwiseAdvantageError` (a :class:`~verl_traj.core.errors.TrajInputError`) whose
``field`` names the input, with the offending value and the fix. Vectorised: one reduction per tensor on a clean
batch.

Pure module: torch, numpy.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from verl_traj.core.errors import TrajInputError, check_binary_mask, check_index, check_shape

__all__ = ["StepwiseAdvantageError", "check_per_row", "check_per_trajectory", "checked_flags", "checked_rows",
           "checked_traj_index"]


class StepwiseAdvantageError(TrajInputError):
    """Step-wise advantage inputs are inconsistent; the message names the field and the fix."""


def checked_traj_index(traj_index: Any, rows: Optional[int]) -> torch.Tensor:
    """``[B]`` int64 CPU ``traj_index`` with entries ``>= -1`` (``rows``: the batch's rows, when known)."""
    return check_index("traj_index", traj_index, "pass the traj_index apply_plan wrote (dense 0..T-1, -1 on padding "
                       "rows), one per row", rows=rows, low=-1, error=StepwiseAdvantageError)


def checked_flags(name: str, flags: Any, rows: int) -> torch.Tensor:
    """``[rows]`` bool CPU flags from bools or 0/1 numbers (NaN, 2, None, strings refused)."""
    fix = f"pass {name} as the expansion wrote it (bool, one per row)"
    try:
        if isinstance(flags, torch.Tensor):
            t = flags.detach().cpu()
        else:
            arr = np.asarray(flags)
            t = torch.as_tensor(arr.astype(np.float64) if arr.dtype.kind not in "biuf" else arr)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise StepwiseAdvantageError.invalid(name, flags, f"is not a bool array ({exc})", fix) from exc
    if t.dim() != 1 or t.shape[0] != rows:
        raise StepwiseAdvantageError.invalid(name, t, f"has shape {tuple(t.shape)}, expected [{rows}]", fix)
    check_binary_mask(name, t, fix, error=StepwiseAdvantageError)
    return t.bool()


def checked_rows(token_level_rewards: Any, response_mask: Any) -> None:
    """``token_level_rewards`` and ``response_mask`` are ``[B, R]`` tensors of one shape; the mask 0/1."""
    for name, t in (("token_level_rewards", token_level_rewards), ("response_mask", response_mask)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise StepwiseAdvantageError.invalid(name, t, "is not a [B, R] tensor", f"pass the batch's {name}")
    check_shape("token_level_rewards", token_level_rewards, tuple(response_mask.shape),
                "rewards and response_mask must come from the same [B, R] batch", error=StepwiseAdvantageError)
    check_binary_mask("response_mask", response_mask, error=StepwiseAdvantageError)


def _length(name: str, value: Any) -> tuple:
    try:
        return np.shape(value)
    except (TypeError, ValueError) as exc:  # ragged nested lists
        raise StepwiseAdvantageError.invalid(name, value, f"is not an array ({exc})", f"pass {name} as a 1-D array") \
            from exc


def _check_lengths(count: int, per: str, named: dict) -> None:
    for name, value in named.items():
        if value is None:
            continue
        shape = _length(name, value)
        if len(shape) != 1 or shape[0] != count:
            raise StepwiseAdvantageError.invalid(name, value, f"has shape {shape}, expected [{count}] (one per {per})",
                                                 f"pass one {name} entry per {per}, in the batch's order")


def check_per_row(rows: int, **named: Any) -> None:
    """Every non-``None`` value in ``named`` is 1-D with ``rows`` entries."""
    _check_lengths(rows, "row", named)


def check_per_trajectory(num_t: int, **named: Any) -> None:
    """Every non-``None`` value in ``named`` is 1-D with ``num_t`` entries."""
    _check_lengths(num_t, "trajectory", named)
