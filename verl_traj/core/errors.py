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

import difflib
import math
import numbers
from typing import Any, Iterable, Mapping, Optional

import numpy as np
import torch

__all__ = ["TrajInputError", "show_value", "check_finite", "check_binary_mask", "check_positive_number", "check_int",
           "check_choice", "check_options", "check_index", "check_shape"]

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

    def __init__(self, message: str, *, field: Optional[str] = None, every_rollout: bool = False):
        message = str(message)
        if field is not None and field not in message:
            message = f"{field}: {message}"
        super().__init__(message)
        self.field = field
        # raised by an agent loop that breaks a contract every rollout breaks the same way (a loop without step
        # records, a wrong reward count): a failed rollout that no refill can fix (core.rollout.failures.FATAL_TAG)
        self.every_rollout = every_rollout

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
    if t.is_complex():
        raise error.invalid(name, t, "is a complex tensor, not a 0/1 mask", fix or f"pass a 0/1 (or bool) {name}")
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


def _suggest(value: Any, choices: Iterable[Any]) -> str:
    """`` (did you mean 'x'?)`` for a near-miss string, else ``""``."""
    if not isinstance(value, str):
        return ""
    close = difflib.get_close_matches(value, [str(c) for c in choices], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_int(name: str, value: Any, fix: str, *, minimum: Optional[int] = None, error: type = TrajInputError) -> int:
    """``int(value)`` for an int, a numpy / 1-element torch integer or a whole finite float, at least ``minimum``;
    else raise ``error`` (field ``name``). Bools, strings, ``None``, NaN and fractions are refused."""
    raw = value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise error.invalid(name, raw, f"is a {type(raw).__name__}, not an integer", fix)
    if not isinstance(value, numbers.Integral):
        as_float = float(value)
        if not math.isfinite(as_float) or as_float != round(as_float):
            raise error.invalid(name, raw, "is not a whole, finite number", fix)
    out = int(value)
    if minimum is not None and out < minimum:
        raise error.invalid(name, raw, f"is below {minimum}", fix)
    return out


def check_choice(name: str, value: Any, choices: Iterable[Any], *, error: type = TrajInputError) -> Any:
    """``value`` if it is one of ``choices`` (a near-miss string is named in the message), else raise ``error``."""
    choices = tuple(choices)
    if not any(isinstance(value, type(c)) and value == c for c in choices):
        raise error.invalid(name, value, f"is not one of {list(choices)}{_suggest(value, choices)}",
                            f"set {name} to one of {list(choices)}")
    return value


def check_options(where: str, given: Mapping[str, Any], allowed: Iterable[str], *,
                  error: type = TrajInputError) -> None:
    """Raise ``error`` (field: the first unknown name) if ``given`` holds a keyword that ``allowed`` does not."""
    allowed = tuple(allowed)
    for key in given:
        if key not in allowed:
            raise error(f"{key!r} is not an option of {where}{_suggest(key, allowed)}. Fix: use one of "
                        f"{sorted(allowed)}.", field=str(key))


def check_shape(name: str, value: Any, shape: tuple, fix: str, *, error: type = TrajInputError) -> torch.Tensor:
    """``value`` if it is a tensor of exactly ``shape``, else raise ``error`` (field ``name``)."""
    if not isinstance(value, torch.Tensor):
        raise error.invalid(name, value, f"is a {type(value).__name__}, not a tensor of shape {tuple(shape)}", fix)
    if tuple(value.shape) != tuple(shape):
        raise error.invalid(name, value, f"has shape {tuple(value.shape)}, expected {tuple(shape)}", fix)
    return value


def check_index(name: str, value: Any, fix: str, *, rows: Optional[int] = None, low: int = 0,
                high: Optional[int] = None, error: type = TrajInputError) -> torch.Tensor:
    """``value`` as a 1-D int64 CPU tensor of ``rows`` entries in ``[low, high)``, else raise ``error``.

    Integer (or whole-valued float) dtypes only; one ``aminmax`` on a clean input."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
    else:
        arr = np.asarray(value)
        if arr.dtype.kind not in "biuf":
            raise error.invalid(name, arr, f"has dtype {arr.dtype}, not an integer index", fix)
        t = torch.from_numpy(np.ascontiguousarray(arr))
    if t.dim() != 1 or (rows is not None and t.shape[0] != rows):
        want = f"[{rows}]" if rows is not None else "1-D"
        raise error.invalid(name, t, f"has shape {tuple(t.shape)}, expected {want} (one entry per row)", fix)
    if t.dtype == torch.bool or t.is_complex():
        raise error.invalid(name, t, f"has dtype {t.dtype}, not an integer index", fix)
    if t.is_floating_point():
        whole = torch.isfinite(t) & (t == torch.round(t))
        if not bool(whole.all()):
            bad = int(torch.nonzero(~whole)[0, 0])
            raise error.invalid(f"{name}[{bad}]", float(t[bad]), "is not a whole, finite index", fix)
    t = t.long()
    if t.numel():
        lo, hi = (int(x) for x in torch.aminmax(t))
        if lo < low or (high is not None and hi >= high):
            bad = int(torch.argmin(t)) if lo < low else int(torch.argmax(t))
            span = f"[{low}, {high})" if high is not None else f">= {low}"
            raise error.invalid(f"{name}[{bad}]", int(t[bad]), f"is out of range {span}", fix)
    return t
