"""Checks of what the step-wise expansion reads (:mod:`verl_traj.stepwise.expand`): the rollout batch's tensors and
options, and each step record's token ids, masks, log-probs and prefix length.

Every refusal is a :class:`StepExpansionError` (a :class:`~verl_traj.core.errors.TrajInputError`) whose ``field``
names the input, with the offending value and the fix. Per-token checks are one reduction per record or tensor.

Pure module: torch, numpy.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Optional

import numpy as np
import torch

from verl_traj.core.errors import TrajInputError, check_binary_mask, check_int

__all__ = ["StepExpansionError", "located", "check_expand_options", "check_source_tensors", "checked_log_probs",
           "checked_loss_mask", "checked_prefix_len", "token_ids"]


class StepExpansionError(TrajInputError):
    """The batch cannot be expanded into step rows; the message names the field and the fix."""


@contextmanager
def located(where: str) -> Iterator[None]:
    """Prefix a :class:`StepExpansionError` raised inside with the record it is about (``row 0 step 2: ...``)."""
    try:
        yield
    except StepExpansionError as err:
        raise StepExpansionError(f"{where}: {err}", field=err.field) from None


def _numbers(name: str, x: Any) -> torch.Tensor:
    """``x`` (list, array, tensor) as a flat CPU tensor of numbers; strings, ``None`` and ragged lists refused."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().reshape(-1)
    try:
        arr = np.asarray(x)
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"dtype {arr.dtype}")
    except (TypeError, ValueError) as exc:
        raise StepExpansionError.invalid(name, x, f"is not a list of numbers ({exc})",
                                         f"record {name} as a list / array / 1-D tensor of numbers") from exc
    return torch.from_numpy(np.ascontiguousarray(arr.reshape(-1)))


def token_ids(name: str, x: Any, where: str) -> torch.Tensor:
    """1-D int64 token ids; fractional, non-finite or negative ids are refused (field ``name``)."""
    with located(where):
        t = _numbers(name, x)
        if t.dtype == torch.bool or t.is_complex():
            raise StepExpansionError.invalid(name, t, f"has dtype {t.dtype}", f"record {name} as int ids")
        if t.is_floating_point():
            whole = torch.isfinite(t) & (t == torch.round(t))
            if not bool(whole.all()):
                raise StepExpansionError.invalid(name, t, "holds a non-whole or non-finite id",
                                                 f"record {name} as int token ids")
        t = t.long()
        if t.numel() and int(t.min()) < 0:
            raise StepExpansionError.invalid(name, t, f"holds a negative token id ({int(t.min())})",
                                             f"record {name} as the tokenizer's ids (>= 0)")
    return t


def checked_loss_mask(m: Any, where: str, n: int) -> torch.Tensor:
    """A record's ``response_mask``: ``n`` entries of 0/1 (int64); all ones when absent."""
    if m is None:
        return torch.ones(n, dtype=torch.long)
    with located(where):
        t = _numbers("response_mask", m)
        if t.numel() != n:
            raise StepExpansionError.invalid("response_mask", t, f"has {t.numel()} entries for {n} response tokens",
                                             "record one 0/1 per response token")
        check_binary_mask("response_mask", t, error=StepExpansionError)
    return t.long()


def checked_log_probs(lp: Any, where: str, n: int) -> torch.Tensor:
    """A record's ``response_logprobs``: ``n`` float32 values, no NaN / +inf (-inf is a log of 0)."""
    name = "response_logprobs"
    with located(where):
        t = _numbers(name, lp).float()
        if t.numel() != n:
            raise StepExpansionError.invalid(name, t, f"has {t.numel()} entries for {n} response tokens",
                                             "record one log-prob per response token")
        if bool((torch.isnan(t) | (t == float("inf"))).any()):
            raise StepExpansionError.invalid(name, t, "holds NaN / +inf",
                                             "record the rollout engine's log-prob of every response token")
    return t


def checked_prefix_len(rec: Mapping[str, Any], where: str, limit: int) -> int:
    """A delta-encoded record's ``prompt_prefix_len``: an int in ``[0, limit]`` (the previous step's context)."""
    name = "prompt_prefix_len"
    fix = (f"prompt_prefix_len counts the tokens shared with the previous step's context ({limit} tokens): an int "
           "in [0, that length] (encode_step_records writes it)")
    with located(where):
        shared = check_int(name, rec.get(name, 0), fix, minimum=0, error=StepExpansionError)
        if shared > limit:
            raise StepExpansionError.invalid(name, shared, f"exceeds the previous step's context ({limit} tokens)",
                                             fix)
    return shared


def check_source_tensors(tensors: Mapping[str, Any], steps: Any, traj_col: Any) -> None:
    """The rollout batch in verl's layout: ``prompts [B, P]``, ``responses``, ``response_mask``, ``rollout_log_probs``
    ``[B, R]``, ``attention_mask [B, P + R]`` 0/1, ``rm_scores [B, ...]``; records / traj ids one per row."""
    fix = "pass the rollout output's tensors as verl builds them (attention_mask = [prompts | responses])"
    for name in ("prompts", "responses"):
        t = tensors[name]
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise StepExpansionError.invalid(name, t, "is not a [B, width] tensor", fix)
    p, r = tensors["prompts"], tensors["responses"]
    rows, width = p.shape[0], r.shape[1]
    for name, shape in (("responses", (rows, width)), ("attention_mask", (rows, p.shape[1] + width)),
                        ("response_mask", (rows, width)), ("rollout_log_probs", (rows, width))):
        t = tensors.get(name)
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape):
            raise StepExpansionError.invalid(name, t, f"has shape {tuple(getattr(t, 'shape', ()))}, expected {shape}",
                                             fix)
    for name in ("attention_mask", "response_mask"):
        check_binary_mask(name, tensors[name], error=StepExpansionError)
    rm = tensors.get("rm_scores")
    if rm is not None and (not isinstance(rm, torch.Tensor) or rm.dim() < 1 or rm.shape[0] != rows):
        raise StepExpansionError.invalid("rm_scores", rm, f"is not a [{rows}, ...] tensor", "one score row per row")
    for name, col in (("steps", steps), ("traj_id", traj_col)):
        if col is None:
            continue
        n = col.shape[0] if isinstance(col, np.ndarray) and col.ndim else len(col) if hasattr(col, "__len__") else -1
        if n != rows:
            raise StepExpansionError.invalid(name, col, f"has {n} entries for {rows} rows", "carry one entry per row")


def check_expand_options(pad_token_id: Any, prompt_width: Optional[Any], response_width: Optional[Any],
                         pad_to_multiple_of: Any, drop_keys: Any) -> None:
    """The expansion's options: ints in range, ``drop_keys`` a collection of names."""
    check_int("pad_token_id", pad_token_id, "pass resolve_pad_token_id(tokenizer.pad_token_id, ...)", minimum=0,
              error=StepExpansionError)
    for name, value in (("prompt_width", prompt_width), ("response_width", response_width)):
        if value is not None:
            check_int(name, value, f"pass {name} as an int >= 1, or None for the longest step row", minimum=1,
                      error=StepExpansionError)
    check_int("pad_to_multiple_of", pad_to_multiple_of, "pass an int >= 1", minimum=1, error=StepExpansionError)
    if isinstance(drop_keys, (str, bytes)) or not all(isinstance(k, str) for k in drop_keys):
        raise StepExpansionError.invalid("drop_keys", drop_keys, "is not a list of field names",
                                         "pass e.g. drop_keys=['routed_experts']")
