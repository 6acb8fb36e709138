"""Expand a rollout batch (one row per trajectory) into step rows (one row per LLM call).

verl's v0 trainer needs one agent-loop output per input row, so the step-wise agent loop returns the
usual concatenated multi-turn row and carries each LLM call as a record in ``extra_fields`` (->
``non_tensor_batch[steps_key]``, one list of records per row). :func:`expand_step_rows` turns that
batch into step rows, optionally prefix-merged (:mod:`verl_traj.stepwise.prefix_merge`), in verl's
layout: prompts left-padded, responses right-padded to common widths, ``input_ids``,
``attention_mask``, ``position_ids`` (1-D text positions), ``response_mask``, ``rollout_log_probs``
and ``rm_scores`` rebuilt. Per-row fields (``uid``, ``data_source``, ``reward_model``, ...) are
repeated onto every step row. New ``non_tensor`` fields: ``traj_id``, ``step_index``,
``is_last_step`` (names configurable).

Reward: the trajectory's reward (sum of the source row's ``rm_scores``) goes on its LAST step row
only (at that row's last response token); every other step row gets 0. Rewards are therefore
counted once per trajectory, and :func:`verl_traj.stepwise.advantages.compute_trajectory_advantages`
reads them from the last-step rows.

A record is a mapping with ``prompt_ids`` and ``response_ids`` (lists, arrays or 1-D tensors) and
optional ``response_mask`` and ``response_logprobs``. To keep the rollout -> trainer transfer O(T)
instead of O(T^2), a record may instead give ``prompt_prefix_len`` + ``prompt_tail_ids``: its prompt
is the first ``prompt_prefix_len`` tokens of the previous step's prompt+response followed by the tail
(:func:`encode_step_records` builds this form). A row's records may be a list, or a dict
``{"steps": [...]}`` (numpy cannot mis-broadcast a dict when verl stacks ``extra_fields``). Rows without records fall back to
:func:`steps_from_row`: the concatenated row cut at the runs of ``response_mask == 1`` (exact for
token-in/token-out agent loops such as verl's ``ToolAgentLoop``, whose observations are masked 0).

Pure module: torch, numpy, stdlib. Per-token work is vectorised (``pad_sequence``, masks from
lengths); the Python loops run over rows and steps only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from verl_traj.stepwise.prefix_merge import MergedRow, MergeStats, merge_trajectory_steps

__all__ = [
    "DEFAULT_STEPS_KEY",
    "StepExpansionError",
    "ExpandedBatch",
    "steps_from_row",
    "encode_step_records",
    "decode_step_records",
    "expand_step_rows",
    "mask_non_last_step_rewards",
]

DEFAULT_STEPS_KEY = "traj_steps"
# Tensor fields rebuilt by the expansion.
_REBUILT = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask",
            "rollout_log_probs", "rm_scores")
# Per-token tensors that cannot be re-derived for step rows.
_PER_TOKEN_UNSUPPORTED = ("routed_experts", "teacher_logprobs", "teacher_ids")


class StepExpansionError(ValueError):
    """The batch cannot be expanded into step rows; the message names the field and the fix."""


@dataclass
class ExpandedBatch:
    """Output of :func:`expand_step_rows`.

    Attributes:
        tensors: name -> [B', ...] tensors (verl's layout, see module docstring).
        non_tensors: name -> np.ndarray [B'] (object / int / bool).
        source_row: LongTensor [B']: the input row each step row came from.
        source_steps: list (len B') of the record indices merged into each row.
        stats: rows / tokens / loss tokens before and after merging (before = one row per step).
    """

    tensors: dict[str, torch.Tensor]
    non_tensors: dict[str, np.ndarray]
    source_row: torch.Tensor
    source_steps: list[list[int]]
    stats: MergeStats

    def metrics(self, prefix: str = "traj_stepwise") -> dict[str, float]:
        out = self.stats.metrics(prefix)
        out[f"{prefix}/trajectories"] = float(len(torch.unique(self.source_row))) if self.source_row.numel() else 0.0
        return out


def _as_long(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().reshape(-1).long()
    return torch.as_tensor(np.asarray(x, dtype=np.int64).reshape(-1))


def steps_from_row(
    prompt_ids: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    log_probs: Optional[torch.Tensor] = None,
) -> list[dict[str, torch.Tensor]]:
    """Cut a concatenated multi-turn row (unpadded) into steps at the runs of ``response_mask != 0``.

    Step k's prompt is ``prompt + response[:start_k]`` (everything before its first generated
    token), its response the run of generated tokens. A row without any generated token is one
    step with an empty response.
    """
    mask = response_mask.reshape(-1) != 0
    n = mask.numel()
    if n == 0 or not bool(mask.any()):
        rec = {"prompt_ids": prompt_ids, "response_ids": response_ids[:0], "response_mask": response_mask[:0]}
        if log_probs is not None:
            rec["response_logprobs"] = log_probs[:0]
        return [rec]
    m = mask.to(torch.int8)
    edges = torch.diff(m, prepend=torch.zeros(1, dtype=torch.int8), append=torch.zeros(1, dtype=torch.int8))
    starts = torch.nonzero(edges == 1).reshape(-1).tolist()
    ends = torch.nonzero(edges == -1).reshape(-1).tolist()
    out = []
    for s, e in zip(starts, ends):
        rec = {
            "prompt_ids": torch.cat([prompt_ids, response_ids[:s]]),
            "response_ids": response_ids[s:e],
            "response_mask": response_mask[s:e],
        }
        if log_probs is not None:
            rec["response_logprobs"] = log_probs[s:e]
        out.append(rec)
    return out


def _common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    if n == 0:
        return 0
    neq = np.flatnonzero(a[:n] != b[:n])
    return int(neq[0]) if neq.size else n


def encode_step_records(calls: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Compact per-call records (prompt delta-encoded against the previous step's full context).

    ``calls``: per LLM call, ``prompt_ids`` and ``response_ids`` (and optional ``response_logprobs``,
    ``response_mask``). Returns ``{"steps": [...]}`` with int32/float32 numpy arrays.
    """
    steps = []
    prev_full: Optional[np.ndarray] = None
    for call in calls:
        prompt = np.asarray(call["prompt_ids"], dtype=np.int64).reshape(-1)
        resp = np.asarray(call["response_ids"], dtype=np.int64).reshape(-1)
        shared = _common_prefix_len(prev_full, prompt) if prev_full is not None else 0
        rec: dict[str, Any] = {
            "prompt_prefix_len": shared,
            "prompt_tail_ids": prompt[shared:].astype(np.int32),
            "response_ids": resp.astype(np.int32),
        }
        if call.get("response_logprobs") is not None:
            rec["response_logprobs"] = np.asarray(call["response_logprobs"], dtype=np.float32).reshape(-1)
        if call.get("response_mask") is not None:
            rec["response_mask"] = np.asarray(call["response_mask"], dtype=np.int8).reshape(-1)
        steps.append(rec)
        prev_full = np.concatenate([prompt, resp])
    return {"steps": steps}


def decode_step_records(records: Any) -> list[dict[str, Any]]:
    """Records (list, or ``{"steps": [...]}``, full or delta-encoded) -> list of full records."""
    if isinstance(records, Mapping):
        records = records.get("steps", [])
    out: list[dict[str, Any]] = []
    prev_full: Optional[torch.Tensor] = None
    for k, rec in enumerate(records):
        resp = _as_long(rec["response_ids"])
        if "prompt_ids" in rec and rec["prompt_ids"] is not None:
            prompt = _as_long(rec["prompt_ids"])
        elif "prompt_tail_ids" in rec:
            shared = int(rec.get("prompt_prefix_len", 0))
            if shared and (prev_full is None or shared > prev_full.numel()):
                raise StepExpansionError(
                    f"step record {k}: prompt_prefix_len={shared} exceeds the previous step's context "
                    f"({0 if prev_full is None else prev_full.numel()} tokens)."
                )
            head = prev_full[:shared] if shared else torch.zeros(0, dtype=torch.long)
            prompt = torch.cat([head, _as_long(rec["prompt_tail_ids"])])
        else:
            raise StepExpansionError(f"step record {k} has neither prompt_ids nor prompt_tail_ids.")
        full = dict(rec)
        full["prompt_ids"] = prompt
        full["response_ids"] = resp
        out.append(full)
        prev_full = torch.cat([prompt, resp])
    return out


def _response_parts(rec: Mapping[str, Any], b: int, k: int, has_lp: bool):
    """(response ids, response mask, log-probs or None) of one record, validated."""
    r = _as_long(rec["response_ids"])
    m = rec.get("response_mask")
    m = torch.ones(r.numel(), dtype=torch.long) if m is None else _as_long(m)
    if m.numel() != r.numel():
        raise StepExpansionError(f"row {b} step {k}: response_mask has {m.numel()} entries for {r.numel()} tokens.")
    lp = None
    if has_lp:
        lp = rec.get("response_logprobs")
        if lp is None:
            raise StepExpansionError(
                f"row {b} step {k}: the batch has rollout_log_probs but the step record has no "
                "response_logprobs; record the log-probs of every LLM call (or drop rollout_log_probs)."
            )
        lp = (lp.detach().cpu() if isinstance(lp, torch.Tensor) else torch.as_tensor(lp)).reshape(-1).float()
        if lp.numel() != r.numel():
            raise StepExpansionError(f"row {b} step {k}: response_logprobs has {lp.numel()} entries for {r.numel()} tokens.")
    return r, m, lp


def _merge_delta_encoded(steps: Sequence[Mapping[str, Any]], b: int, has_lp: bool):
    """Prefix merge straight from delta-encoded records (same result as decode + merge_trajectory_steps).

    Step k+1 continues step k's row iff its ``prompt_prefix_len`` equals step k's full context length
    (the common prefix is the whole previous context). Rows are built from response and tail segments.
    """
    n = len(steps)
    parts = [_response_parts(rec, b, k, has_lp) for k, rec in enumerate(steps)]
    tails = [_as_long(rec["prompt_tail_ids"]) for rec in steps]
    pre = [int(rec.get("prompt_prefix_len", 0)) for rec in steps]
    full_len = [pre[k] + tails[k].numel() + parts[k][0].numel() for k in range(n)]
    for k in range(n):
        limit = full_len[k - 1] if k else 0
        if pre[k] < 0 or pre[k] > limit:
            raise StepExpansionError(
                f"row {b} step record {k}: prompt_prefix_len={pre[k]} exceeds the previous step's context ({limit} tokens)."
            )
    stats = MergeStats(rows_before=n, tokens_before=int(sum(full_len)),
                       loss_tokens_before=int(sum(int(torch.count_nonzero(m)) for _, m, _ in parts)))
    rows: list[MergedRow] = []
    prompt = None
    segs: list[torch.Tensor] = []
    msegs: list[torch.Tensor] = []
    lsegs: list[torch.Tensor] = []
    start = 0

    def close(end: int) -> None:
        rows.append(MergedRow(
            prompt_ids=prompt,
            response_ids=torch.cat(segs) if len(segs) > 1 else segs[0],
            response_mask=torch.cat(msegs) if len(msegs) > 1 else msegs[0],
            per_token={"lp": torch.cat(lsegs) if len(lsegs) > 1 else lsegs[0]} if has_lp else {},
            source_steps=list(range(start, end + 1)),
            step_index=len(rows),
            is_last_step=end == n - 1,
        ))

    for k in range(n):
        r, m, lp = parts[k]
        if k and pre[k] == full_len[k - 1]:  # continues the current row
            tail = tails[k]
            if tail.numel():
                segs.append(tail)
                msegs.append(torch.zeros(tail.numel(), dtype=m.dtype))
                if has_lp:
                    lsegs.append(torch.zeros(tail.numel(), dtype=lp.dtype))
        else:
            if k:
                prev_full = torch.cat([prompt] + segs)
                close(k - 1)
                prompt = torch.cat([prev_full[: pre[k]], tails[k]]) if pre[k] else tails[k]
            else:
                prompt = tails[0]
            segs, msegs, lsegs, start = [], [], [], k
        segs.append(r)
        msegs.append(m)
        if has_lp:
            lsegs.append(lp)
    close(n - 1)
    stats.rows_after = len(rows)
    stats.tokens_after = sum(row.num_tokens for row in rows)
    stats.loss_tokens_after = sum(int(torch.count_nonzero(row.response_mask)) for row in rows)
    return rows, stats


def _left_pad(seqs: list[torch.Tensor], width: int, value) -> torch.Tensor:
    if not seqs:
        return torch.zeros(0, width, dtype=torch.long)
    flipped = pad_sequence([s.flip(0) for s in seqs], batch_first=True, padding_value=value)
    out = flipped.flip(1)
    if out.shape[1] < width:
        out = torch.nn.functional.pad(out, (width - out.shape[1], 0), value=value)
    return out


def _right_pad(seqs: list[torch.Tensor], width: int, value) -> torch.Tensor:
    out = pad_sequence(seqs, batch_first=True, padding_value=value)
    if out.shape[1] < width:
        out = torch.nn.functional.pad(out, (0, width - out.shape[1]), value=value)
    return out


def expand_step_rows(
    tensors: Mapping[str, torch.Tensor],
    non_tensors: Mapping[str, np.ndarray],
    *,
    steps_key: str = DEFAULT_STEPS_KEY,
    merge_prefix: bool = False,
    pad_token_id: int = 0,
    traj_id_key: str = "traj_id",
    step_index_key: str = "step_index",
    is_last_step_key: str = "is_last_step",
    prompt_width: Optional[int] = None,
    response_width: Optional[int] = None,
    pad_to_multiple_of: int = 1,
    drop_keys: Sequence[str] = (),
) -> ExpandedBatch:
    """Expand one-row-per-trajectory rollout output into step rows (optionally prefix-merged).

    Args:
        tensors: the batch's tensors: ``prompts`` [B, P] (left-padded), ``responses`` [B, R],
            ``attention_mask`` [B, P+R], ``response_mask`` [B, R]; optional ``rollout_log_probs``
            and ``rm_scores`` [B, R]; other [B] / [B, k] per-row tensors are repeated.
        non_tensors: ``non_tensor_batch``; ``steps_key`` holds each row's list of step records
            (``None`` / missing: cut the row with :func:`steps_from_row`). ``traj_id_key`` (if
            present and not None) names each row's trajectory, else ``"__row{b}"``.
        merge_prefix: merge consecutive steps whose context prefixes the next (``traj.merge_prefix``).
        pad_token_id: id written into padding positions of ``prompts`` / ``responses`` / ``input_ids``.
        prompt_width / response_width: output widths (default: the longest step row, rounded up to
            ``pad_to_multiple_of``); a row longer than a given width raises.
        drop_keys: tensor / non-tensor fields to drop instead of carrying (e.g. ``routed_experts``).

    Returns:
        :class:`ExpandedBatch`. Step rows are grouped by source row, in step order.
    """
    for key in ("prompts", "responses", "attention_mask", "response_mask"):
        if key not in tensors:
            raise StepExpansionError(f"tensor field {key!r} is missing; step expansion needs the rollout output's "
                                     "prompts, responses, attention_mask and response_mask.")
    drop = set(drop_keys)
    prompts_t = tensors["prompts"].detach().cpu()
    responses_t = tensors["responses"].detach().cpu()
    attn = tensors["attention_mask"].detach().cpu()
    resp_mask_t = tensors["response_mask"].detach().cpu()
    B, P = prompts_t.shape
    R = responses_t.shape[1]
    if "position_ids" in tensors and tensors["position_ids"].dim() != 2:
        raise StepExpansionError(
            f"position_ids has shape {tuple(tensors['position_ids'].shape)}: multi-dimensional (VLM M-RoPE) position ids "
            "are not supported with step-wise rows yet. Use traj.step_wise=false for multi-modal models."
        )
    for key in _PER_TOKEN_UNSUPPORTED:
        if key in tensors and key not in drop:
            raise StepExpansionError(
                f"tensor field {key!r} is per token and cannot be re-derived for step rows; pass drop_keys=[{key!r}] "
                "(e.g. disable router replay / distillation) or use traj.step_wise=false."
            )
    mmi = non_tensors.get("multi_modal_inputs")
    if mmi is not None and "multi_modal_inputs" not in drop and any(x is not None and len(x) for x in mmi):
        raise StepExpansionError("multi_modal_inputs are not supported with step-wise rows yet; use traj.step_wise=false.")
    has_lp = "rollout_log_probs" in tensors
    lp_t = tensors["rollout_log_probs"].detach().cpu() if has_lp else None
    has_rm = "rm_scores" in tensors
    traj_reward = tensors["rm_scores"].detach().cpu().float().sum(-1) if has_rm else None

    prompt_len = attn[:, :P].sum(-1).tolist()
    resp_len = attn[:, P:].sum(-1).tolist()
    records_col = non_tensors.get(steps_key)
    traj_col = non_tensors.get(traj_id_key)

    out_prompts: list[torch.Tensor] = []
    out_resps: list[torch.Tensor] = []
    out_masks: list[torch.Tensor] = []
    out_lps: list[torch.Tensor] = []
    src_row: list[int] = []
    src_steps: list[list[int]] = []
    step_idx: list[int] = []
    is_last: list[bool] = []
    traj_ids: list[Any] = []
    stats = MergeStats()

    for b in range(B):
        raw = records_col[b] if records_col is not None else None
        raw_steps = raw.get("steps", []) if isinstance(raw, Mapping) else raw
        if merge_prefix and raw_steps is not None and len(raw_steps) and all(
            "prompt_tail_ids" in r and r.get("prompt_ids") is None for r in raw_steps
        ):
            # fast path: delta-encoded records decide every boundary from their prefix lengths; only
            # the prompts that start a row are materialised (O(T) instead of O(T^2) copies)
            rows, st = _merge_delta_encoded(raw_steps, b, has_lp)
        else:
            recs = decode_step_records(raw) if raw is not None else None
            if not recs:
                pl, rl = int(prompt_len[b]), int(resp_len[b])
                recs = steps_from_row(
                    prompts_t[b, P - pl :], responses_t[b, :rl], resp_mask_t[b, :rl], lp_t[b, :rl] if has_lp else None
                )
            prompts_b, resps_b, masks_b, lps_b = [], [], [], []
            for k, rec in enumerate(recs):
                prompts_b.append(_as_long(rec["prompt_ids"]))
                r, m, lp = _response_parts(rec, b, k, has_lp)
                resps_b.append(r)
                masks_b.append(m)
                if has_lp:
                    lps_b.append(lp)
            rows, st = merge_trajectory_steps(
                prompts_b, resps_b, masks_b, {"lp": lps_b} if has_lp else None, enable=merge_prefix
            )
        stats = stats + st
        tid = traj_col[b] if traj_col is not None and traj_col[b] is not None else f"__row{b}"
        for row in rows:
            out_prompts.append(row.prompt_ids)
            out_resps.append(row.response_ids)
            out_masks.append(row.response_mask)
            if has_lp:
                out_lps.append(row.per_token["lp"])
            src_row.append(b)
            src_steps.append(row.source_steps)
            step_idx.append(row.step_index)
            is_last.append(row.is_last_step)
            traj_ids.append(tid)

    n_out = len(out_prompts)
    p_lens = torch.tensor([p.numel() for p in out_prompts], dtype=torch.long)
    r_lens = torch.tensor([r.numel() for r in out_resps], dtype=torch.long)

    def _width(given: Optional[int], lens: torch.Tensor, name: str) -> int:
        longest = int(lens.max()) if lens.numel() else 0
        if given is None:
            w = max(longest, 1)
            mult = max(int(pad_to_multiple_of), 1)
            return -(-w // mult) * mult
        if longest > given:
            raise StepExpansionError(f"a step row has a {name} of {longest} tokens, above {name}_width={given}.")
        return int(given)

    Pw = _width(prompt_width, p_lens, "prompt")
    Rw = _width(response_width, r_lens, "response")
    new_prompts = _left_pad(out_prompts, Pw, pad_token_id)
    new_resps = _right_pad(out_resps, Rw, pad_token_id) if n_out else torch.zeros(0, Rw, dtype=torch.long)
    prompt_attn = (torch.arange(Pw).unsqueeze(0) >= (Pw - p_lens).unsqueeze(1)).long()
    resp_attn = (torch.arange(Rw).unsqueeze(0) < r_lens.unsqueeze(1)).long()
    attention_mask = torch.cat([prompt_attn, resp_attn], dim=1).to(attn.dtype)
    mask_dtype = resp_mask_t.dtype
    new_mask = (_right_pad([m.to(mask_dtype) for m in out_masks], Rw, 0) if n_out
                else torch.zeros(0, Rw, dtype=mask_dtype)) * resp_attn.to(mask_dtype)
    out_t: dict[str, torch.Tensor] = {
        "prompts": new_prompts.to(prompts_t.dtype),
        "responses": new_resps.to(responses_t.dtype),
        "input_ids": torch.cat([new_prompts, new_resps], dim=1).to(prompts_t.dtype),
        "attention_mask": attention_mask,
        "position_ids": torch.clip(torch.cumsum(attention_mask.long(), dim=-1) - 1, min=0),
        "response_mask": new_mask,
    }
    if has_lp:
        out_t["rollout_log_probs"] = (_right_pad(out_lps, Rw, 0.0) if n_out else torch.zeros(0, Rw)).to(lp_t.dtype)
    src = torch.tensor(src_row, dtype=torch.long)
    last_t = torch.tensor(is_last, dtype=torch.bool)
    if has_rm:
        rm = torch.zeros(n_out, Rw, dtype=tensors["rm_scores"].dtype)
        pos = (r_lens - 1).clamp(min=0)
        rows_idx = torch.arange(n_out)
        rm[rows_idx[last_t], pos[last_t]] = traj_reward[src[last_t]].to(rm.dtype)
        out_t["rm_scores"] = rm
    for key, value in tensors.items():
        if key in _REBUILT or key in drop:
            continue
        if value.dim() >= 1 and value.shape[0] == B and (value.dim() == 1 or value.shape[1] not in (P, R, P + R)):
            out_t[key] = value.detach().cpu()[src]
        else:
            raise StepExpansionError(
                f"tensor field {key!r} with shape {tuple(value.shape)} looks per-token; it cannot be carried onto step rows. "
                f"Pass drop_keys=[{key!r}] or compute it after the expansion."
            )

    out_nt: dict[str, np.ndarray] = {}
    src_np = src.numpy()
    for key, value in non_tensors.items():
        if key in drop or key in (steps_key, traj_id_key, step_index_key, is_last_step_key):
            continue
        arr = np.asarray(value)
        if arr.shape[:1] != (B,):
            raise StepExpansionError(f"non_tensor field {key!r} has shape {arr.shape}, expected [{B}, ...].")
        out_nt[key] = arr[src_np]
    tid_arr = np.empty(n_out, dtype=object)
    tid_arr[:] = traj_ids
    out_nt[traj_id_key] = tid_arr
    out_nt[step_index_key] = np.asarray(step_idx, dtype=np.int64)
    out_nt[is_last_step_key] = np.asarray(is_last, dtype=bool)
    return ExpandedBatch(tensors=out_t, non_tensors=out_nt, source_row=src, source_steps=src_steps, stats=stats)


def mask_non_last_step_rewards(token_level_scores: torch.Tensor, is_last_step: Any) -> torch.Tensor:
    """Zero the rewards of non-last step rows (for reward managers that score every row).

    Returns a new tensor; rows with ``is_last_step`` False become 0.
    """
    last = torch.as_tensor(np.asarray(is_last_step, dtype=bool)).to(token_level_scores.device)
    return token_level_scores * last.unsqueeze(-1).to(token_level_scores.dtype)
