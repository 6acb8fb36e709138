"""Materialise a :class:`~verl_traj.core.plan.planning.MiniBatchPlan` on a batch's columns.

verl's row layout: ``prompts`` ``[B, P]`` (left-padded), ``responses`` ``[B, R]`` (right-padded),
``input_ids`` / ``attention_mask`` ``[B, P+R]``, ``position_ids`` ``[B, P+R]`` or ``[B, k, P+R]``
(multi-dimensional rope, VLMs), ``response_mask`` ``[B, R]``.

A padding row has the real rows' schema and changes no loss, advantage, group statistic or metric:

* tensors: ``pad_row_tokens`` attended tokens from the last prompt position ``P-1`` on,
  ``pad_token_id`` in ``input_ids`` / ``prompts`` / ``responses``, all-zero ``response_mask`` and every
  other tensor (``rm_scores``, ``token_level_scores``, ``rollout_log_probs``, ``routed_experts``, ...);
* non-tensor fields: object fields are a copy of a real row of the same mini-batch (so every consumer
  that reads ``raw_prompt``, ``reward_model``, ``extra_info``, ``data_source``, ... sees the type and
  structure it expects); numeric fields are 0 (neutral in any sum, e.g. verl's per-request counters);
  its own ``uid`` ``"__verl_traj_pad__{k}"`` (a GRPO group of one, with no response token) and its own
  trajectory id, ``step_index`` 0, ``is_last_step`` True and ``multi_modal_inputs`` ``{}`` (no image
  features without image tokens).

The plan's per-row facts travel with the batch (:mod:`verl_traj.core.keys`): ``mini_batch_id``,
``micro_batch_id``, ``traj_index`` and ``is_padding`` are added as tensors.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping, Optional

import numpy as np
import torch

from verl_traj.core.errors import TrajInputError, check_int, show_value
from verl_traj.core.keys import IS_LAST_STEP, IS_PADDING, MICRO_BATCH_ID, MINI_BATCH_ID, PLAN_KEYS, TRAJ_INDEX
from verl_traj.core.plan.planning import PAD_ROW_TOKENS, PAD_UID_PREFIX, MiniBatchPlan

__all__ = ["apply_plan", "pad_attention_mask", "pad_position_ids", "resolve_pad_token_id"]

_TOKEN_KEYS = ("input_ids", "prompts", "responses")


def pad_attention_mask(length: int, prompt_length: int, num_tokens: int = PAD_ROW_TOKENS, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``[length]`` mask of a padding row: 1 on ``num_tokens`` positions from ``prompt_length - 1`` on."""
    m = torch.zeros(length, dtype=dtype)
    start = max(prompt_length - 1, 0)
    m[start: min(start + num_tokens, length)] = 1
    return m


def pad_position_ids(mask: torch.Tensor) -> torch.Tensor:
    """verl's ``compute_position_id_with_mask``: ``clip(cumsum(mask) - 1, min=0)``."""
    return torch.clamp(torch.cumsum(mask.long(), dim=-1) - 1, min=0)


def _prompt_length(tensors: dict[str, torch.Tensor], prompt_length: Optional[int]) -> Optional[int]:
    """``P``: ``prompts``' width, else ``prompt_length``, else ``L - R``; checked against the attention mask:
    ``1 <= P < L`` (a padding row attends the last prompt position and the first response position)."""
    am, rm = tensors.get("attention_mask"), tensors.get("response_mask")
    if "prompts" in tensors:
        name, p = "tensors['prompts'].shape[1]", int(tensors["prompts"].shape[1]) if tensors["prompts"].dim() > 1 else 0
    elif prompt_length is not None:
        name = "prompt_length"
        p = check_int(name, prompt_length, "pass the prompt width P (attention_mask is [B, P + R])", minimum=1)
    elif am is not None and rm is not None and am.dim() == 2 and rm.dim() == 2:
        name, p = "attention_mask.shape[1] - response_mask.shape[1]", int(am.shape[1] - rm.shape[1])  # verl: L = P + R
    else:
        return None
    if am is not None and am.dim() == 2 and not 1 <= p < am.shape[1]:
        raise TrajInputError.invalid(
            name, p, f"does not fit the attention mask's {am.shape[1]} positions (expected 1 <= P < L = P + R)",
            "pass the batch's own prompts / attention_mask (verl: attention_mask is [B, prompt width + response "
            "width])")
    return p


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def resolve_pad_token_id(pad_token_id: Any, eos_token_id: Any = None) -> int:
    """The token id written into padding positions: the tokenizer's pad token, else its eos token.

    Rule (verl's own ``hf_tokenizer`` does the same when it loads a tokenizer without a pad token):
    ``pad_token_id`` when it is set; when it is ``None``, ``eos_token_id`` (the first one, if a
    generation config lists several). Falling back is safe here: a padding position is never attended
    (attention_mask 0) and never a loss token (response_mask 0), and a padding row carries weight 0, so
    the id written there changes no forward result, loss or gradient. Refused: both ``None`` (no
    token to pad with), or a value that is not a non-negative int (a bool, a float, a string, -1).

    Call it once, where the tokenizer enters (the trainer's start-up), and pass the result on as
    ``pad_token_id`` to :func:`apply_plan` and the step-wise expansion.
    """
    fix = ("load the tokenizer with a pad token (tokenizer.pad_token = tokenizer.eos_token, as verl's hf_tokenizer "
           "does) or set tokenizer.pad_token_id to a token id of the vocabulary")
    if pad_token_id is None:
        eos = eos_token_id
        if isinstance(eos, (list, tuple)) and eos:
            eos = eos[0]
        if eos is None or isinstance(eos, (list, tuple)):
            raise TrajInputError(
                f"tokenizer.pad_token_id=None and tokenizer.eos_token_id={eos_token_id!r}: there is no token to write "
                f"into padding positions. Fix: {fix}.", field="tokenizer.pad_token_id",
            )
        if not _is_int(eos) or int(eos) < 0:
            raise TrajInputError.invalid("tokenizer.eos_token_id", eos_token_id,
                                         "is not a non-negative int (tokenizer.pad_token_id is None)", fix)
        return int(eos)
    if not _is_int(pad_token_id) or int(pad_token_id) < 0:
        raise TrajInputError.invalid("tokenizer.pad_token_id", pad_token_id, "is not a non-negative int token id", fix)
    return int(pad_token_id)


def _check_rows(tensors: dict[str, torch.Tensor], non_tensors: dict[str, np.ndarray], rows: int) -> None:
    for name, value in (("tensors", tensors), ("non_tensors", non_tensors)):
        if not isinstance(value, Mapping):
            raise TrajInputError.invalid(name, value, f"is a {type(value).__name__}, not a mapping",
                                         f"pass {name} as {{name: column}} (batch.batch / batch.non_tensor_batch)")
    am = tensors.get("attention_mask")
    if isinstance(am, torch.Tensor) and am.dim() != 2:
        raise TrajInputError.invalid("tensors['attention_mask']", am, f"has {am.dim()} dims, expected [B, L]",
                                     "pass the batch's attention_mask ([B, prompt width + response width])")
    for name, t in tensors.items():
        field = f"tensors[{name!r}]"
        if not isinstance(t, torch.Tensor):
            raise TrajInputError(f"{field} is {type(t).__name__}, expected a torch.Tensor. Fix: pass the batch's "
                                 "tensors (non-tensor fields go in non_tensors).", field=field)
        if t.dim() == 0:
            raise TrajInputError(f"{field} is a 0-d tensor (value {show_value(t)}), not one entry per row. Fix: a "
                                 "batch-level scalar is not a batch column: keep it in meta_info, or expand it to [B].",
                                 field=field)
        if t.shape[0] != rows:
            raise TrajInputError(f"{field} has {t.shape[0]} rows but the plan was built for {rows} rows. Fix: apply "
                                 "the plan to the batch it was built from.", field=field)
    for name, arr in non_tensors.items():
        field = f"non_tensors[{name!r}]"
        try:
            np.shape(arr)
        except (TypeError, ValueError) as exc:  # ragged nested lists
            raise TrajInputError.invalid(field, arr, f"is not an array ({exc})", "pass each non-tensor column as a "
                                         "numpy array of B entries (dtype=object)") from exc
        if np.ndim(arr) == 0:
            raise TrajInputError(f"{field} is a scalar ({show_value(arr)}), not one entry per row. Fix: keep it in "
                                 "meta_info, or give every row an entry.", field=field)
        if np.shape(arr)[0] != rows:
            raise TrajInputError(f"{field} has {np.shape(arr)[0]} rows but the plan was built for {rows} rows. Fix: "
                                 "apply the plan to the batch it was built from.", field=field)


def _pad_tensor(name: str, g: torch.Tensor, idx: torch.Tensor, prompt_len: Optional[int], pad_tokens: int,
                pad_token_id: int) -> None:
    """Overwrite the padding rows ``idx`` of the gathered tensor ``g`` in place."""
    if name in _TOKEN_KEYS:
        g[idx] = pad_token_id
    elif name == "attention_mask" and g.dim() == 2:
        g[idx] = pad_attention_mask(g.shape[1], prompt_len, pad_tokens, g.dtype).to(g.device)
    elif name == "position_ids":
        pos = pad_position_ids(pad_attention_mask(g.shape[-1], prompt_len or 1, pad_tokens)).to(g.dtype).to(g.device)
        g[idx] = pos.expand(g.shape[1:]) if g.dim() > 2 else pos
    else:
        g[idx] = 0


def _apply_tensors(tensors: dict[str, torch.Tensor], plan: MiniBatchPlan, prompt_len: Optional[int],
                   pad_token_id: int) -> dict[str, torch.Tensor]:
    gather = plan.order.clamp(min=0)
    pad_idx = torch.nonzero(plan.is_padding, as_tuple=False).reshape(-1)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name in PLAN_KEYS:
            continue
        g = t.index_select(0, gather.to(t.device))
        if pad_idx.numel():
            _pad_tensor(name, g, pad_idx.to(t.device), prompt_len, int(plan.spec.pad_row_tokens), pad_token_id)
        out[name] = g
    out[MINI_BATCH_ID] = plan.mini_batch_id.clone()
    out[MICRO_BATCH_ID] = plan.micro_batch_id.clone()
    out[TRAJ_INDEX] = plan.traj_index.clone()
    out[IS_PADDING] = plan.is_padding.clone()
    return out


def _donor_rows(plan: MiniBatchPlan) -> np.ndarray:
    """``[P]`` output position of a real row of the same mini-batch, for every padding row."""
    mb = plan.mini_batch_id.numpy()
    pad = plan.is_padding.numpy()
    real_pos = np.flatnonzero(~pad)
    first_real = np.full(plan.num_mini_batches, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(first_real, mb[real_pos], real_pos)  # every mini-batch holds a real row (plan invariant)
    return first_real[mb[pad]]


def apply_plan(
    tensors: dict[str, torch.Tensor],
    non_tensors: dict[str, np.ndarray],
    plan: MiniBatchPlan,
    *,
    prompt_length: Optional[int] = None,
    pad_token_id: int = 0,
    traj_key: str = "traj_id",
    step_key: str = "step_index",
) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """Reorder rows by ``plan.order``, fill padding rows, attach the plan's per-row facts.

    Args:
        tensors: ``{name: [B, ...]}`` (every tensor's first dim is the row).
        non_tensors: ``{name: [B]}`` numpy arrays (object or numeric).
        plan: from :func:`plan_mini_batches` on these rows (``plan.num_source_rows == B``).
        prompt_length: ``P`` when there is no ``prompts`` tensor (else ``P = prompts.shape[1]``; last
            resort ``attention_mask.shape[1] - response_mask.shape[1]``).
    Returns:
        New ``(tensors, non_tensors)`` with ``B_out`` rows; tensors gain :data:`~verl_traj.core.keys.PLAN_KEYS`
        (an input copy of any of them, tensor or non-tensor, is replaced).
    """
    if not isinstance(plan, MiniBatchPlan):
        raise TrajInputError.invalid("plan", plan, "is not a MiniBatchPlan",
                                     "pass the result of plan_mini_batches(...)")
    _check_rows(tensors, non_tensors, plan.num_source_rows)
    if not _is_int(pad_token_id) or int(pad_token_id) < 0:
        raise TrajInputError.invalid("pad_token_id", pad_token_id, "is not a non-negative int token id",
                                     "pass resolve_pad_token_id(tokenizer.pad_token_id, tokenizer.eos_token_id)")
    prompt_len = _prompt_length(tensors, prompt_length)
    if bool(plan.is_padding.any()) and prompt_len is None and "attention_mask" in tensors:
        raise TrajInputError(
            "apply_plan needs the prompt length to build padding rows: pass tensors['prompts'] or prompt_length=P.",
            field="prompt_length",
        )
    out_t = _apply_tensors(tensors, plan, prompt_len, pad_token_id)
    gather = plan.order.clamp(min=0).numpy()
    pad_rows = np.flatnonzero(plan.is_padding.numpy())
    donors = _donor_rows(plan)
    out_nt: dict[str, np.ndarray] = {}
    for name, arr in non_tensors.items():
        if name in PLAN_KEYS:
            continue
        g = np.asarray(arr)[gather]  # fancy indexing copies
        if pad_rows.size:
            g = _fill_padding(name, g, pad_rows, donors, traj_key, step_key)
        out_nt[name] = g
    return out_t, out_nt


def _fill_padding(name: str, g: np.ndarray, pad_rows: np.ndarray, donors: np.ndarray, traj_key: str,
                  step_key: str) -> np.ndarray:
    """Padding rows of one gathered non-tensor column: own ids; objects copied from the donor row; numbers 0."""
    if name in ("uid", traj_key):
        return _unique_pad_ids(name, g, pad_rows)
    if name == step_key:
        g[pad_rows] = 0
    elif name == IS_LAST_STEP:
        g[pad_rows] = True
    elif name == "multi_modal_inputs":
        for row in pad_rows.tolist():
            g[row] = {}
    elif g.dtype == object:
        for row, donor in zip(pad_rows.tolist(), donors.tolist()):
            g[row] = copy.deepcopy(g[donor])
    else:
        g[pad_rows] = 0
    return g


def _unique_pad_ids(name: str, g: np.ndarray, pad_rows: np.ndarray) -> np.ndarray:
    """Ids no real row carries: ``max + 1 + k`` for integer ids, ``"__verl_traj_pad__{k}"`` otherwise."""
    n = pad_rows.size
    real = np.ones(g.shape[0], dtype=bool)
    real[pad_rows] = False
    if g.dtype.kind in "iu":
        g[pad_rows] = (int(g[real].max()) + 1 if real.any() else 0) + np.arange(n)
        return g
    labels = np.array([f"{PAD_UID_PREFIX}{k}" for k in range(n)], dtype=object)
    clash = np.isin(labels.astype(str), g[real].astype(str))
    if clash.any():
        raise TrajInputError(
            f"real {name} {labels[clash][0]!r} collides with the padding ids ({PAD_UID_PREFIX}k). Fix: rename it "
            "upstream (that prefix is reserved for padding rows).", field=name,
        )
    g = g.astype(object, copy=False)
    g[pad_rows] = labels
    return g
