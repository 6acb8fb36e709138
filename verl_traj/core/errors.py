"""One error class for everything verl_traj refuses at its boundaries, and the pure checks that raise it.

What enters from verl (masks, ids, rewards, the tokenizer), from an agent loop (step records) or from
the user (the ``traj:`` section) is checked once, where it enters. Every refusal is a
:class:`TrajInputError` (a ``ValueError``) whose ``field`` names the input, and whose message holds
the field, the offending value and the fix. The module-specific errors are subclasses
(``BatchLayoutError``, ``TrajConfigError``, ``StepExpansionError``, ``StepwiseAdvantageError``, ...),
so a caller catches them all with ``except TrajInputError``.

The checks are vectorised (one reduction over the tensor, no Python loop over rows) and cheap enough
to run on every training step: a clean batch costs one pass over its data; only a bad one pays for
the extra work of naming the offending row.

Pure module: torch, numpy and stdlib.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional

import numpy as np
import torch

__all__ = ["TrajInputError", "show_value", "check_finite", "check_binary_mask", "check_positive_number"]

_MAX_REPR = 120


def show_value(value: Any) -> str:
    """Short ``repr`` of an offending value for a message (arrays: dtype, shape, first entries)."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().reshape(-1)[:6].cpu().tolist()
        return f"tensor(dtype={value.dtype}, shape={tuple(value.shape)}, first={flat})"
    if isinstance(value, np.ndarray):
        return f"array(dtype={value.dtype}, shape={value.shape}, first={value.reshape(-1)[:6].tolist()})"
    text = repr(value)
    return text if len(text) <= _MAX_REPR else text[: _MAX_REPR - 3] + "..."


class TrajInputError(ValueError):
    """Invalid input to verl_traj: ``field`` names it; the message names the field, the value and the fix.

    Construct it with a full message (``TrajInputError(msg, field="uid")``; the field is prepended
    when the message does not already name it) or from its parts with :meth:`invalid`. ``field`` is
    ``None`` only for errors raised without one (older call sites); it survives pickling (Ray).
    """

    def __init__(self, message: str, *, field: Optional[str] = None):
        message = str(message)
        if field is not None and field not in message:
            message = f"{field}: {message}"
        super().__init__(message)
        self.field = field

    @classmethod
    def invalid(cls, field: str, value: Any, problem: str, fix: str) -> "TrajInputError":
        """``"{field}={value} {problem}. Fix: {fix}"`` as an error of this class."""
        return cls(f"{field}={show_value(value)} {problem}. Fix: {fix}", field=field)


def check_finite(name: str, tensor: Any, fix: str, *, error: type = TrajInputError) -> None:
    """Raise ``error`` (field ``name``) if ``tensor`` holds a NaN or an infinity; no-op for integer dtypes.

    One reduction over the tensor (on its own device); on failure the message gives the count and the
    first offending (row, value). For the advantage / reward inputs: a NaN reward poisons the mean and
    std of its whole group, and every advantage of that group becomes NaN.
    """
    t = tensor if isinstance(tensor, torch.Tensor) else torch.as_tensor(np.asarray(tensor))
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return
    if bool(torch.isfinite(t).all()):
        return
    bad = ~torch.isfinite(t)
    count = int(bad.sum())
    first = torch.nonzero(bad)[0].tolist()
    value = t[tuple(first)].item()
    where = f"row {first[0]}" + (f", column {first[1:]}" if len(first) > 1 else "")
    raise error(
        f"{name} holds {count} non-finite value(s) (first: {value} at {where} of shape {tuple(t.shape)}). "
        f"Fix: {fix}",
        field=name,
    )


def check_binary_mask(name: str, mask: Any, fix: Optional[str] = None, *, error: type = TrajInputError) -> None:
    """Raise ``error`` (field ``name``) unless every entry of ``mask`` is 0 or 1 (bool masks always pass).

    Integer masks cost one ``aminmax``; float masks one comparison pass (0.5 and NaN are refused).
    """
    t = mask if isinstance(mask, torch.Tensor) else torch.as_tensor(np.asarray(mask))
    if t.dtype == torch.bool or t.numel() == 0:
        return
    if t.is_floating_point():
        ok = bool(((t == 0) | (t == 1)).all())
    else:
        lo, hi = torch.aminmax(t)
        ok = int(lo) >= 0 and int(hi) <= 1
    if ok:
        return
    bad = (t != 0) & (t != 1)
    first = torch.nonzero(bad)[0].tolist()
    values = torch.unique(t[bad].reshape(-1)[:1000]).cpu()[:6].tolist()
    raise error(
        f"{name} must hold only 0 and 1 (1 = the token counts); found {values} (first at row {first[0]}, "
        f"position {first[1:] if len(first) > 1 else '-'}; dtype {t.dtype}). Fix: "
        + (fix or f"pass a 0/1 (or bool) {name}; a weighted mask is not a mask, fold weights into the loss."),
        field=name,
    )


def check_positive_number(name: str, value: Any, fix: str, *, error: type = TrajInputError) -> float:
    """``float(value)`` if it is a finite real number > 0 (not a bool), else raise ``error`` (field ``name``)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise error.invalid(name, value, f"is a {type(value).__name__}, not a number", fix)
    as_float = float(value)
    if not math.isfinite(as_float) or as_float <= 0:
        raise error.invalid(name, value, "is not a finite positive number", fix)
    return as_float
