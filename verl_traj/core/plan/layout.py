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

import numbers
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from verl_traj.core.errors import TrajInputError, check_binary_mask

__all__ = ["BatchLayoutError", "BatchLayout", "build_layout", "build_layout_from_counts", "check_ids", "factorize"]


class BatchLayoutError(TrajInputError):
    """Invalid batch structure. ``field`` names the input; the message names it, the offending value and the fix."""


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


def _as_1d(name: str, value: Any, n: Optional[int]) -> np.ndarray:
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


def _as_flags(name: str, value: Any, n: int) -> np.ndarray:
    """``[n]`` bool flags from bools or 0/1 numbers; anything else (2, NaN, None, strings) is refused."""
    arr = _as_1d(name, value, n)
    if arr.dtype == bool:
        return arr
    fix = f"pass {name} as bools (or 0/1), one per row"
    if arr.dtype.kind not in "iuf":
        arr = _numeric_array(name, arr)
    check_binary_mask(name, arr, fix, error=BatchLayoutError)
    return arr.astype(bool)


def _row_counts(name: str, mask: Any) -> Any:
    """Per-row counts of a ``[B, L]`` 0/1 mask (refused unless 0/1), or ``[B]`` counts as given (checked later)."""
    if not isinstance(mask, torch.Tensor):
        mask = torch.as_tensor(_numeric_array(name, mask))
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
    uid_arr = _required_uid(uid, n)
    pad = np.zeros(n, dtype=bool) if is_padding is None else _as_flags("is_padding", is_padding, n)
    real = _RealRows(pad)
    _check_real_counts(num_tokens, num_loss_tokens, count_names, real)
    _check_padding_has_no_loss(num_loss_tokens, count_names[1], real)
    real_uid = real.take(uid_arr)
    check_ids("uid", real_uid, real.index)
    groups = factorize(real_uid, "uid")[0]
    ids = _trajectories(traj_id, step_index, real)
    traj_group = groups[ids.first]
    _check_one_uid_per_trajectory(ids, groups, traj_group, real_uid)
    counts = np.bincount(ids.codes, minlength=ids.num).astype(np.int64)
    if traj_id is not None:
        _check_steps(ids, counts)
    derived_last = ids.steps == (counts[ids.codes] - 1)
    if is_last_step is not None:
        given_last = real.take(_as_flags("is_last_step", is_last_step, n))
        _check_last_steps(ids, given_last, derived_last)
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


def _numeric_array(name: str, value: Any) -> np.ndarray:
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


def _checked_counts(name: str, value: Any) -> torch.Tensor:
    """``[B]`` per-row token counts as CPU int64; NaN, inf, fractional and negative counts are refused."""
    t = value.detach().cpu() if isinstance(value, torch.Tensor) else torch.as_tensor(_numeric_array(name, value))
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


def _check_padding_has_no_loss(num_loss_tokens: torch.Tensor, name: str, real: "_RealRows") -> None:
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
                       real: "_RealRows") -> None:
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


_is_instance = np.frompyfunc(isinstance, 2, 1)


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


def _required_uid(uid: Any, n: int) -> np.ndarray:
    if uid is None:
        raise BatchLayoutError(
            "uid is missing. Fix: every row needs its prompt-group id in non_tensor_batch['uid'] "
            "(verl's fit() assigns one uuid per prompt before repeat(n)).", field="uid",
        )
    return _as_1d("uid", uid, n)


def _int_steps(steps: np.ndarray) -> np.ndarray:
    """``[N]`` int64 steps; floats must be whole numbers; ``None``, strings and other objects are refused."""
    if steps.dtype.kind in "iub":
        return steps.astype(np.int64)
    as_float = _numeric_array("step_index", steps).astype(np.float64)
    whole = np.isfinite(as_float) & (np.mod(as_float, 1) == 0) & (np.abs(as_float) < 2**62)
    if not np.all(whole):
        raise BatchLayoutError(
            f"step_index must be whole numbers; got {as_float[~whole][:4].tolist()}. "
            "Fix: pass int step numbers.", field="step_index",
        )
    return as_float.astype(np.int64)


class _RealRows:
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
class _Trajectories:
    """Dense trajectory codes of the real rows, their steps, and each trajectory's first row."""

    codes: np.ndarray  # [N_real] 0..T-1
    steps: np.ndarray  # [N_real]
    first: np.ndarray  # [T] first real row of each trajectory
    ids: Optional[np.ndarray]  # [N_real] original traj ids (None: one row per trajectory)
    real: _RealRows

    @property
    def num(self) -> int:
        return int(self.codes.max()) + 1

    def name(self, t: int) -> Any:
        """Human-readable id of trajectory ``t`` for error messages."""
        if self.ids is not None:
            return self.ids[self.first[t]]
        row = int(self.first[t]) if self.real.index is None else int(self.real.index[self.first[t]])
        return f"row {row}"


def _trajectories(traj_id: Any, step_index: Any, real: _RealRows) -> _Trajectories:
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
        return _Trajectories(rows, np.zeros(real.count, dtype=np.int64), rows, None, real)
    ids = real.take(_as_1d("traj_id", traj_id, real.n))
    check_ids("traj_id", ids, real.index)
    codes, first = factorize(ids, "traj_id")
    return _Trajectories(codes, real.take(_int_steps(_as_1d("step_index", step_index, real.n))), first, ids, real)


def _check_one_uid_per_trajectory(ids: _Trajectories, groups: np.ndarray, traj_group: np.ndarray,
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


def _check_steps(ids: _Trajectories, counts: np.ndarray) -> None:
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


def _check_last_steps(ids: _Trajectories, given: np.ndarray, derived: np.ndarray) -> None:
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
