"""Rows of token ids as one flat array (issue 40, item 2): what the prefix-tree planner, the tree facts and the tree
builder take, checked once where they enter.

A batch's attended token ids arrive as a padded ``[B, S]`` batch (v0) or a nested one (v1). :class:`TokenRows` holds
them as one int64 array and row offsets, so reordering the rows (the plan's order), cutting them by micro-batch and
comparing them are array operations, not a tensor or a Python object per row. Pure module (torch and numpy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from verl_traj.core.errors import TrajInputError

__all__ = ["TokenRows", "token_rows"]

ROWS_FIX = ("pass a list of 1-D integer tensors, one per row: its attended token ids, no padding "
            "(input_ids[i][attention_mask[i].bool()]); an empty tensor for a padding row")


@dataclass(frozen=True, eq=False)
class TokenRows:
    """``R`` rows of token ids: row ``r`` is ``ids[offsets[r]:offsets[r + 1]]``. ``ids`` ``[T]`` int64, every id
    ``>= 0``; ``offsets`` ``[R + 1]`` int64, non-decreasing from 0 to ``T``. Built by :func:`token_rows` (checked)
    or :meth:`of_padded`; the constructor checks the shapes and offsets, and the ids' sign with one min."""

    ids: np.ndarray
    offsets: np.ndarray

    def __post_init__(self):
        ids, offsets = self.ids, self.offsets
        if ids.dtype != np.int64 or ids.ndim != 1 or offsets.dtype != np.int64 or offsets.ndim != 1 or not offsets.size:
            raise TrajInputError.invalid("rows", self, "is not [T] int64 ids with [R + 1] int64 offsets",
                                         "build it with token_rows(rows)")
        if offsets[0] != 0 or offsets[-1] != ids.size or (offsets.size > 1 and (np.diff(offsets) < 0).any()):
            raise TrajInputError.invalid("rows.offsets", offsets, f"do not run non-decreasing from 0 to {ids.size}",
                                         "build it with token_rows(rows)")
        if ids.size and int(ids.min()) < 0:
            t = int(np.flatnonzero(ids < 0)[0])
            r = int(np.searchsorted(offsets, t, side="right")) - 1
            raise TrajInputError.invalid(f"rows[{r}][{t - int(offsets[r])}]", int(ids[t]),
                                         "is a negative token id (a padding or ignore value?)", ROWS_FIX)

    @property
    def num_rows(self) -> int:
        return int(self.offsets.size) - 1

    @property
    def lengths(self) -> np.ndarray:  # [R]
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return self.num_rows

    def row(self, r: int) -> np.ndarray:
        return self.ids[self.offsets[r]:self.offsets[r + 1]]

    def as_list(self) -> list[np.ndarray]:
        """``R`` int64 views into ``ids``."""
        return np.split(self.ids, self.offsets[1:-1]) if self.num_rows else []

    def take(self, index: Any) -> "TokenRows":
        """The rows ``index`` ``[K]`` (ints in ``0..R-1``, repeats allowed), in that order: one gather."""
        index = np.asarray(index, dtype=np.int64)
        lengths = self.lengths[index]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        source = np.arange(int(offsets[-1]), dtype=np.int64)
        source += np.repeat(self.offsets[index] - offsets[:-1], lengths)
        return TokenRows(self.ids[source], offsets)

    @staticmethod
    def concat(first: "TokenRows", second: "TokenRows") -> "TokenRows":
        """``first``'s rows, then ``second``'s."""
        return TokenRows(np.concatenate([first.ids, second.ids]),
                        np.concatenate([first.offsets, first.offsets[-1] + second.offsets[1:]]))

    @staticmethod
    def of_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> "TokenRows":
        """Each row's attended ids of a padded ``[B, S]`` batch (host tensors): one boolean index in numpy."""
        mask = attention_mask.detach().cpu().numpy().astype(bool)
        ids = input_ids.detach().cpu().numpy()[mask].astype(np.int64, copy=False)
        return TokenRows(ids, np.concatenate([[0], np.cumsum(mask.sum(-1))]).astype(np.int64))

    @staticmethod
    def of_flat(ids: Any, lengths: Any) -> "TokenRows":
        """Rows from one flat ``[T]`` id array (tensor or array) and ``[R]`` lengths summing to ``T``."""
        flat = ids.detach().to("cpu", torch.int64).numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids, np.int64)
        lengths = lengths.cpu().numpy() if isinstance(lengths, torch.Tensor) else np.asarray(lengths)
        return TokenRows(flat, np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64))


def _checked_row(name: str, row: Any) -> np.ndarray:
    """One row as a 1-D int64 array: 1-D, an integer dtype unless empty (``torch.tensor([])`` is a padding row)."""
    if type(row) is np.ndarray and row.dtype == np.int64 and row.ndim == 1:
        return row
    if isinstance(row, torch.Tensor):
        if row.dim() != 1:
            raise TrajInputError.invalid(name, row, f"has shape {tuple(row.shape)}, not 1-D", ROWS_FIX)
        if row.numel() and (row.dtype == torch.bool or row.is_floating_point() or row.is_complex()):
            raise TrajInputError.invalid(name, row, f"has dtype {row.dtype}, not an integer dtype", ROWS_FIX)
        return row.detach().to("cpu", torch.int64).numpy()
    if isinstance(row, (str, bytes)) or not isinstance(row, (np.ndarray, Sequence)):
        raise TrajInputError.invalid(name, row, f"is a {type(row).__name__}, not a 1-D integer tensor", ROWS_FIX)
    try:
        arr = np.asarray(row)
    except ValueError:  # a ragged nested list
        arr = np.asarray(row, dtype=object)
    if arr.ndim != 1:
        raise TrajInputError.invalid(name, arr, f"has shape {arr.shape}, not 1-D", ROWS_FIX)
    if arr.size and arr.dtype.kind not in "iu":
        raise TrajInputError.invalid(name, arr, f"has dtype {arr.dtype}, not an integer dtype", ROWS_FIX)
    return arr.astype(np.int64)


def token_rows(rows: Any) -> TokenRows:
    """``rows`` as :class:`TokenRows` (returned as is when it already is one): a list of 1-D integer tensors, arrays
    or int lists, one per row (an empty one for a padding row). Raises :class:`TrajInputError` naming ``rows`` (not a
    list: a padded ``[B, S]`` batch would put its padding into a tree) or ``rows[i]`` / ``rows[i][j]`` (not 1-D, not
    integer, a negative id)."""
    if isinstance(rows, TokenRows):
        return rows
    if isinstance(rows, (torch.Tensor, np.ndarray, str, bytes)) or not isinstance(rows, Sequence):
        raise TrajInputError.invalid("rows", rows, "is not a list of rows (a padded [B, S] batch would put its padding "
                                     "into the tree)", ROWS_FIX)
    arrays = [_checked_row(f"rows[{i}]", row) for i, row in enumerate(rows)]
    ids = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
    return TokenRows(ids, np.concatenate([[0], np.cumsum([a.size for a in arrays], dtype=np.int64)]).astype(np.int64))
