"""Materialise a :class:`~verl_traj.core.planning.MiniBatchPlan` on a batch's columns.

verl's row layout: ``prompts`` ``[B, P]`` (left-padded), ``responses`` ``[B, R]`` (right-padded),
``input_ids`` / ``attention_mask`` ``[B, P+R]``, ``position_ids`` ``[B, P+R]`` or ``[B, k, P+R]``
(multi-dimensional rope, VLMs), ``response_mask`` ``[B, R]``.

A padding row has the real rows' schema (same keys, shapes and dtypes) and is minimal: 2 attended
tokens (last prompt position ``P-1`` and first response position ``P``), ``pad_token_id``
everywhere in ``input_ids`` / ``prompts`` / ``responses``, all-zero ``response_mask`` /
``loss_mask`` and every other tensor (``rm_scores``, ``token_level_scores``, ``rollout_log_probs``,
``routed_experts``, ...), so it never changes a loss, an advantage, a group statistic or a metric.
Non-tensor fields: its own ``uid`` ``"__verl_traj_pad__{k}"`` (a GRPO group of one with no response
token), its own ``traj_id``, ``step_index`` 0, ``is_last_step`` True, ``multi_modal_inputs`` ``{}``,
other object fields ``None``, numeric fields 0.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from .planning import PAD_UID_PREFIX, MiniBatchPlan

__all__ = ["apply_plan", "pad_attention_mask", "pad_position_ids"]

_TOKEN_KEYS = ("input_ids", "prompts", "responses")
_TRUE_KEYS = ("is_last_step",)


def pad_attention_mask(length: int, prompt_length: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``[length]`` mask of a padding row: 1 at ``prompt_length - 1`` and ``prompt_length`` only."""
    m = torch.zeros(length, dtype=dtype)
    for pos in (prompt_length - 1, prompt_length):
        if 0 <= pos < length:
            m[pos] = 1
    return m


def pad_position_ids(mask: torch.Tensor) -> torch.Tensor:
    """verl's ``compute_position_id_with_mask``: ``clip(cumsum(mask) - 1, min=0)``."""
    return torch.clamp(torch.cumsum(mask.long(), dim=-1) - 1, min=0)


def _prompt_length(tensors: dict[str, torch.Tensor], prompt_length: Optional[int]) -> Optional[int]:
    if "prompts" in tensors:
        return int(tensors["prompts"].shape[1])
    if prompt_length is not None:
        return int(prompt_length)
    am, rm = tensors.get("attention_mask"), tensors.get("response_mask")
    if am is not None and rm is not None and am.dim() == 2 and rm.dim() == 2:
        return int(am.shape[1] - rm.shape[1])  # verl: L = P + R
    return None


def apply_plan(
    tensors: dict[str, torch.Tensor],
    non_tensors: dict[str, np.ndarray],
    plan: MiniBatchPlan,
    *,
    prompt_length: Optional[int] = None,
    pad_token_id: int = 0,
    traj_key: str = "traj_id",
    step_key: str = "step_index",
    is_padding_non_tensor: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """Reorder rows by ``plan.order`` and fill padding rows; returns new dicts (inputs untouched).

    Args:
        tensors: ``{name: [B, ...]}`` (every tensor's first dim is the row).
        non_tensors: ``{name: [B]}`` numpy arrays (object or numeric).
        plan: from :func:`plan_mini_batches` on these rows (``plan.num_source_rows == B``).
        prompt_length: ``P`` when there is no ``prompts`` tensor (else ``P = prompts.shape[1]``; last
            resort ``attention_mask.shape[1] - response_mask.shape[1]``).
        is_padding_non_tensor: also add ``is_padding`` as a bool array to ``non_tensors``. Off by default:
            verl's ``DataProto.to_tensordict`` refuses a key that is both a tensor and a non-tensor field.
    Returns:
        ``(tensors, non_tensors)`` with ``B_out`` rows, plus ``is_padding`` (bool tensor) and
        ``mini_batch_id`` (int64 tensor). An input ``is_padding`` (either kind) is replaced.
    """
    B = plan.num_source_rows
    order = plan.order
    pad = plan.is_padding
    n_pad = int(pad.sum())
    gather = order.clamp(min=0)
    pad_pos = torch.nonzero(pad, as_tuple=False).reshape(-1)
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{name!r}] is {type(t).__name__}, expected a torch.Tensor")
        if t.shape[0] != B:
            raise ValueError(f"tensors[{name!r}] has {t.shape[0]} rows but the plan was built for {B} rows")
    P = _prompt_length(tensors, prompt_length)
    if n_pad and P is None and "attention_mask" in tensors:
        raise ValueError(
            "apply_plan needs the prompt length to build padding rows: pass tensors['prompts'] or prompt_length=P."
        )
    out_t: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name in ("is_padding", "mini_batch_id"):
            continue
        g = t.index_select(0, gather.to(t.device))
        if n_pad:
            idx = pad_pos.to(t.device)
            if name in _TOKEN_KEYS:
                g[idx] = pad_token_id
            elif name == "attention_mask" and t.dim() == 2:
                g[idx] = pad_attention_mask(t.shape[1], P, t.dtype).to(t.device)
            elif name == "position_ids":
                mask = pad_attention_mask(t.shape[-1], P if P is not None else 1)
                pos = pad_position_ids(mask).to(t.dtype).to(t.device)
                g[idx] = pos.expand(t.shape[1:]) if t.dim() > 2 else pos
            else:
                g[idx] = 0
        out_t[name] = g
    out_t["is_padding"] = pad.clone()
    out_t["mini_batch_id"] = plan.mini_batch_id.clone()

    gather_np = gather.numpy()
    pad_np = pad.numpy()
    pad_rows = np.flatnonzero(pad_np)
    out_nt: dict[str, np.ndarray] = {}
    for name, arr in non_tensors.items():
        arr = np.asarray(arr)
        if arr.shape[0] != B:
            raise ValueError(f"non_tensors[{name!r}] has {arr.shape[0]} rows but the plan was built for {B} rows")
        if name == "is_padding":
            continue
        g = arr[gather_np]  # fancy indexing copies
        if n_pad:
            g = _fill_padding(name, arr, g, pad_rows, traj_key, step_key)
        out_nt[name] = g
    if is_padding_non_tensor:
        out_nt["is_padding"] = pad_np.copy()
    return out_t, out_nt


def _fill_padding(name: str, src: np.ndarray, g: np.ndarray, pad_rows: np.ndarray, traj_key: str, step_key: str) -> np.ndarray:
    n = pad_rows.shape[0]
    labels = np.array([f"{PAD_UID_PREFIX}{k}" for k in range(n)], dtype=object)
    if name == "uid" or name == traj_key:
        if g.dtype.kind in "iu":
            g[pad_rows] = (int(src.max()) + 1 if src.size else 0) + np.arange(n)
        elif g.dtype == object:
            if name == "uid":
                real = np.ones(g.shape[0], dtype=bool)
                real[pad_rows] = False
                clash = np.isin(labels.astype(str), g[real].astype(str))
                if clash.any():
                    raise ValueError(
                        f"real uid {labels[clash][0]!r} collides with the padding uids ({PAD_UID_PREFIX}k); "
                        "rename it upstream"
                    )
            g[pad_rows] = labels
        else:
            g = g.astype(object)
            g[pad_rows] = labels
        return g
    if g.dtype == object:
        if name == "multi_modal_inputs":
            fill: Any = np.empty(n, dtype=object)
            for k in range(n):
                fill[k] = {}
            g[pad_rows] = fill
        elif name in _TRUE_KEYS:
            g[pad_rows] = True
        else:
            g[pad_rows] = None
        return g
    if name in _TRUE_KEYS:
        g[pad_rows] = True
    else:
        g[pad_rows] = 0
    return g
