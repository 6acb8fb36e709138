"""A batch layout's inputs, checked row by row where they enter (:mod:`verl_traj.core.plan.layout` builds the
layout from them): ids factorised to dense codes, flags and step indices coerced, the real rows apart from the
padding rows, each trajectory's rows and steps, and every refusal (:class:`BatchLayoutError`) naming the input, the
offending value and the fix. Vectorised numpy: no Python loop over rows.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from verl_traj.core.errors import TrajInputError, check_binary_mask

__all__ = ["BatchLayoutError", "RealRows", "Trajectories", "as_1d", "as_flags", "check_ids", "check_last_steps",
           "check_one_uid_per_trajectory", "check_steps", "factorize", "int_steps", "numeric_array", "required_uid",
           "trajectories"]

_is_instance = np.frompyfunc(isinstance, 2, 1)  # elementwise isinstance over an object array


class BatchLayoutError(TrajInputError):
    """Invalid batch structure. ``field`` names the input; the message names it, the offending value and the fix."""


def factorize(values: np.ndarray, name: str = "ids") -> tuple[np.ndarray, np.ndarray]:
    """Dense codes in first-appearance order.

    Args:
        values: 1-D array (numeric, or object array of hashable str/int).
        name: the field the values come from (named in the error for incomparable ids).
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
        raise BatchLayoutError(
            f"{name} must be mutually comparable (all str or all int); got {exc}. "
            f"Fix: give every row a {name} of one type.", field=name,
        ) from exc
    inverse = inverse.reshape(-1)
    rank = np.empty(first.shape[0], dtype=np.int64)
    by_first = np.argsort(first, kind="stable")
    rank[by_first] = np.arange(first.shape[0], dtype=np.int64)
    return rank[inverse], first[by_first].astype(np.int64)


def as_1d(name: str, value: Any, n: Optional[int]) -> np.ndarray:
    try:
        arr = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    except (TypeError, ValueError) as exc:  # ragged nested lists
        raise BatchLayoutError.invalid(name, value, f"is not a 1-D array ({exc})",
                                       f"pass {name} as a numpy array of length B") from exc
    if arr.ndim != 1:
        raise BatchLayoutError(
            f"{name} must be 1-D with one entry per row; got shape {tuple(arr.shape)}. "
            f"Fix: pass {name} as a numpy array of length B.", field=name,
        )
    if n is not None and arr.shape[0] != n:
        raise BatchLayoutError(
            f"{name} has {arr.shape[0]} entries but the batch has {n} rows (attention_mask.shape[0]). "
            f"Fix: {name} must carry exactly one entry per row, in row order.", field=name,
        )
    return arr


def as_flags(name: str, value: Any, n: int) -> np.ndarray:
    """``[n]`` bool flags from bools or 0/1 numbers; anything else (2, NaN, None, strings) is refused."""
    arr = as_1d(name, value, n)
    if arr.dtype == bool:
        return arr
    fix = f"pass {name} as bools (or 0/1), one per row"
    if arr.dtype.kind not in "iuf":
        arr = numeric_array(name, arr)
    check_binary_mask(name, arr, fix, error=BatchLayoutError)
    return arr.astype(bool)


def numeric_array(name: str, value: Any) -> np.ndarray:
    """``value`` as a numeric numpy array (``None`` entries, strings, ... refused)."""
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as exc:  # ragged nested lists
        raise BatchLayoutError.invalid(name, value, f"is not an array ({exc})", f"pass {name} as one tensor") from exc
    if arr.dtype.kind in "biuf":
        return arr
    if arr.dtype == object:  # astype(float) would turn None into NaN: name it as given
        none = np.flatnonzero(np.asarray(arr.reshape(-1) == None, dtype=bool))  # noqa: E711
        if none.size:
            raise BatchLayoutError.invalid(f"{name}[{int(none[0])}]", None, "is None",
                                           f"every row needs a whole number for {name}")
    numeric = _is_instance(arr, numbers.Real).astype(bool) if arr.dtype == object else np.zeros(1, dtype=bool)
    if not numeric.all():  # strings ("1" would parse), complex numbers, bytes, arbitrary objects
        raise BatchLayoutError.invalid(name, arr, f"is not numeric (dtype {arr.dtype}: strings, complex numbers or "
                                       "other objects)",
                                       f"pass {name} as int counts / a 0/1 mask, one entry per row")
    try:
        return arr.astype(np.float64)
    except (TypeError, ValueError) as exc:
        raise BatchLayoutError.invalid(
            name, arr, f"is not numeric ({exc})", f"pass {name} as int counts / a 0/1 mask, one entry per row"
        ) from exc


def check_ids(name: str, ids: np.ndarray, rows: Optional[np.ndarray] = None) -> None:
    """Refuse ``None``, NaN and mixed str / non-str ids (``1`` and ``"1"`` would otherwise be one group).

    Vectorised numpy passes over the ids; ``rows`` maps positions in ``ids`` to batch rows (messages).
    """
    def row(i: int) -> int:
        return int(i) if rows is None else int(rows[i])

    fix = (f"every row needs a {name} of one type (all str, e.g. uuid4 strings, or all int); fix the producer "
           f"of {name}")
    if ids.dtype.kind == "f":
        nan = np.isnan(ids)
        if nan.any():
            raise BatchLayoutError.invalid(f"{name}[{row(np.argmax(nan))}]", float("nan"), "is NaN", fix)
        return
    if ids.dtype != object or ids.size == 0:
        return
    try:
        none = np.asarray(ids == None, dtype=bool)  # noqa: E711  (elementwise on an object array)
        nan = np.asarray(ids != ids, dtype=bool)  # NaN is the only id not equal to itself
    except (TypeError, ValueError):  # elements whose == is not a bool (arrays): factorize decides
        return
    for mask, what in ((none, "is None"), (nan, "is NaN")):
        if mask.shape == ids.shape and mask.any():
            i = int(np.argmax(mask))
            raise BatchLayoutError.invalid(f"{name}[{row(i)}]", ids[i], what, fix)
    is_str = _is_instance(ids, str).astype(bool)
    if is_str.any() and not is_str.all():
        i, j = int(np.argmax(is_str)), int(np.argmax(~is_str))
        raise BatchLayoutError.invalid(
            f"{name}[{row(j)}]", ids[j], f"is a {type(ids[j]).__name__} but {name}[{row(i)}]={ids[i]!r} is a str "
            f"(ids are compared as strings, so 1 and '1' would be one id)", fix,
        )


def required_uid(uid: Any, n: int) -> np.ndarray:
    if uid is None:
        raise BatchLayoutError(
            "uid is missing. Fix: every row needs its prompt-group id in non_tensor_batch['uid'] "
            "(verl's fit() assigns one uuid per prompt before repeat(n)).", field="uid",
        )
    return as_1d("uid", uid, n)


def int_steps(steps: np.ndarray) -> np.ndarray:
    """``[N]`` int64 steps; floats must be whole numbers; ``None``, strings and other objects are refused."""
    if steps.dtype.kind in "iub":
        return steps.astype(np.int64)
    as_float = numeric_array("step_index", steps).astype(np.float64)
    whole = np.isfinite(as_float) & (np.mod(as_float, 1) == 0) & (np.abs(as_float) < 2**62)
    if not np.all(whole):
        raise BatchLayoutError(
            f"step_index must be whole numbers; got {as_float[~whole][:4].tolist()}. "
            "Fix: pass int step numbers.", field="step_index",
        )
    return as_float.astype(np.int64)


class RealRows:
    """The rows not flagged padding: ``take`` selects them, ``scatter`` writes back to ``[B]``."""

    def __init__(self, pad: np.ndarray):
        self.n = int(pad.shape[0])
        self.count = int((~pad).sum())
        if self.count == 0:
            raise BatchLayoutError(
                f"the batch has no real row ({self.n} rows, all flagged is_padding). This is an upstream bug "
                "(rollout produced nothing or every row was masked): fix the producer; refusing to plan an empty "
                "batch.",
                field="is_padding",
            )
        self.index = np.flatnonzero(~pad) if self.count < self.n else None
        self.pad = pad

    def take(self, arr: np.ndarray) -> np.ndarray:
        return arr if self.index is None else arr[self.index]

    def scatter(self, values: np.ndarray, fill: Any, dtype: Any) -> np.ndarray:
        if self.index is None:
            return values.astype(dtype, copy=False)
        out = np.full(self.n, fill, dtype=dtype)
        out[self.index] = values
        return out


@dataclass
class Trajectories:
    """Dense trajectory codes of the real rows, their steps, and each trajectory's first row."""

    codes: np.ndarray  # [N_real] 0..T-1
    steps: np.ndarray  # [N_real]
    first: np.ndarray  # [T] first real row of each trajectory
    ids: Optional[np.ndarray]  # [N_real] original traj ids (None: one row per trajectory)
    real: RealRows

    @property
    def num(self) -> int:
        return int(self.codes.max()) + 1

    def name(self, t: int) -> Any:
        """Human-readable id of trajectory ``t`` for error messages."""
        if self.ids is not None:
            return self.ids[self.first[t]]
        row = int(self.first[t]) if self.real.index is None else int(self.real.index[self.first[t]])
        return f"row {row}"


def trajectories(traj_id: Any, step_index: Any, real: RealRows) -> Trajectories:
    """Dense trajectory codes of the real rows; without ids every row is its own trajectory (step 0)."""
    if (traj_id is None) != (step_index is None):
        given, missing = ("traj_id", "step_index") if step_index is None else ("step_index", "traj_id")
        raise BatchLayoutError(
            f"{given} was given without {missing}. Fix: step-wise rows need both a trajectory id and a step "
            f"index per row (non_tensor_batch['traj_id'], ['step_index']); pass neither for one row per trajectory.",
            field=missing,
        )
    if traj_id is None:
        rows = np.arange(real.count, dtype=np.int64)
        return Trajectories(rows, np.zeros(real.count, dtype=np.int64), rows, None, real)
    ids = real.take(as_1d("traj_id", traj_id, real.n))
    check_ids("traj_id", ids, real.index)
    codes, first = factorize(ids, "traj_id")
    return Trajectories(codes, real.take(int_steps(as_1d("step_index", step_index, real.n))), first, ids, real)


def check_one_uid_per_trajectory(ids: Trajectories, groups: np.ndarray, traj_group: np.ndarray,
                                  uid: np.ndarray) -> None:
    bad = np.flatnonzero(groups != traj_group[ids.codes])
    if bad.size:
        t = int(ids.codes[bad[0]])
        uids = np.unique(uid[ids.codes == t].astype(str)).tolist()
        raise BatchLayoutError(
            f"trajectory traj_id={ids.name(t)!r} has rows with {len(uids)} different uids {uids[:4]}. "
            "Fix: all steps of one trajectory must carry the uid of its prompt group (set uid per prompt, "
            "then copy it to every step row of the trajectory).", field="uid",
        )


def check_steps(ids: Trajectories, counts: np.ndarray) -> None:
    """The steps of every trajectory are exactly ``0..n_t-1`` (a counting sort finds any hole or repeat)."""
    steps, codes = ids.steps, ids.codes
    if steps.size and steps.min() < 0:
        r = int(np.argmin(steps))
        raise BatchLayoutError(
            f"step_index={int(steps[r])} is negative (traj_id={ids.name(int(codes[r]))!r}). "
            "Fix: steps of a trajectory must be numbered 0..n-1.", field="step_index",
        )
    too_big = np.flatnonzero(steps >= counts[codes])
    start = np.cumsum(counts) - counts
    hits = np.bincount(start[codes] + np.minimum(steps, counts[codes] - 1), minlength=codes.shape[0])
    if not too_big.size and np.all(hits == 1):
        return
    if too_big.size:
        t = int(codes[too_big[0]])
    else:
        t = int(np.searchsorted(start, int(np.flatnonzero(hits != 1)[0]), side="right") - 1)
    got = np.sort(steps[codes == t])
    dup = got[1:][got[1:] == got[:-1]]
    missing = np.setdiff1d(np.arange(counts[t]), got)
    raise BatchLayoutError(
        f"trajectory traj_id={ids.name(t)!r} has steps {got[:12].tolist()}{'...' if got.size > 12 else ''}: "
        f"duplicate steps {np.unique(dup)[:8].tolist()}, missing steps {missing[:8].tolist()} "
        f"(expected exactly 0..{counts[t] - 1} for its {counts[t]} rows). Fix: every step of a "
        "trajectory must be in the same batch exactly once (do not drop or duplicate step rows).", field="step_index",
    )


def check_last_steps(ids: Trajectories, given: np.ndarray, derived: np.ndarray) -> None:
    per_traj = np.bincount(ids.codes, weights=given, minlength=ids.num)
    wrong_count = np.flatnonzero(per_traj != 1)
    if wrong_count.size:
        t = int(wrong_count[0])
        raise BatchLayoutError(
            f"trajectory traj_id={ids.name(t)!r} has {int(per_traj[t])} rows with is_last_step=True "
            "(expected exactly 1). Fix: flag exactly the final step of every trajectory; a trajectory "
            "without its last step was truncated upstream (keep all of its steps in the batch).", field="is_last_step",
        )
    mismatch = np.flatnonzero(given != derived)
    if mismatch.size:
        t = int(ids.codes[mismatch[0]])
        flagged = int(ids.steps[given & (ids.codes == t)][0])
        raise BatchLayoutError(
            f"trajectory traj_id={ids.name(t)!r}: is_last_step=True is on step {flagged} but its max step is "
            f"{int(np.bincount(ids.codes)[t]) - 1}. Fix: the last step must be the highest step_index.",
            field="is_last_step",
        )
