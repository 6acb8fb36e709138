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

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from verl_traj.core.keys import IS_LAST_STEP, STEP_ANCHORS, TURN_REWARDS
from verl_traj.core.padding import pad_position_ids
from verl_traj.stepwise.expand_inputs import (StepExpansionError, check_expand_options, check_source_tensors,
                                              checked_log_probs, checked_loss_mask, checked_prefix_len, located,
                                              token_ids)
from verl_traj.stepwise.anchors import observation_anchor, observation_tokens
from verl_traj.stepwise.prefix_merge import MergedRow, MergeStats, RowBuilder, merge_trajectory_steps

__all__ = [
    "DEFAULT_STEPS_KEY",
    "StepExpansionError",
    "ExpandedBatch",
    "steps_from_row",
    "encode_step_records",
    "decode_step_records",
    "expand_step_rows",
    "trajectory_step_rows",
]

DEFAULT_STEPS_KEY = "traj_steps"
TURN_REWARD = "turn_reward"  # per-token values of a step row: each call's own reward on its last response token
STEP_ANCHOR = "step_anchor"  # per-token int64 of a step row: each call's anchor key on its first response token
# Tensor fields rebuilt by the expansion.
_REBUILT = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask",
            "rollout_log_probs", "rm_scores")
# Per-token tensors that cannot be re-derived for step rows.
_PER_TOKEN_UNSUPPORTED = ("routed_experts", "teacher_logprobs", "teacher_ids")


def _check_record(rec: Any, where: str) -> None:
    """A step record is a mapping with non-None ``response_ids`` (what every reader indexes first)."""
    if not isinstance(rec, Mapping):
        raise StepExpansionError(
            f"{where} is a {type(rec).__name__}, not a mapping. Fix: the agent loop must record every LLM call as "
            "a dict with prompt_ids (or prompt_prefix_len + prompt_tail_ids) and response_ids "
            "(encode_step_records builds them; a row's records: a list, or {'steps': [...]}).", field="steps",
        )
    if rec.get("response_ids") is None:
        raise StepExpansionError(
            f"{where} has no response_ids (keys: {sorted(map(str, rec))}). Fix: record the generated token ids of "
            "every LLM call as response_ids (an empty list for a call that generated nothing).", field="response_ids",
        )


def _check_records(records: Any, b: Optional[int]) -> Any:
    """The step records of source row ``b``: ``None``, a list of records, or ``{"steps": [...]}``; returns the list."""
    row = "" if b is None else f"row {b} "
    if isinstance(records, Mapping) and "steps" not in records:
        raise StepExpansionError(f"{row or 'the '}step records are a mapping without 'steps' (keys: "
                                 f"{sorted(map(str, records))[:6]}). Fix: carry a list of per-call dicts, or "
                                 "{'steps': [...]} (encode_step_records builds it).", field="steps")
    steps = records["steps"] if isinstance(records, Mapping) else records
    if steps is None:
        return None
    if isinstance(steps, (str, bytes, Mapping)) or not hasattr(steps, "__len__") or not hasattr(steps, "__iter__"):
        raise StepExpansionError(
            f"{row or 'the '}step records are a {type(steps).__name__}, not a list of records. Fix: carry a list of "
            "per-call dicts (or {'steps': [...]}) in the steps field.", field="steps",
        )
    for k, rec in enumerate(steps):
        _check_record(rec, f"{row}step record {k}")
    return steps


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
    for k, (s, e) in enumerate(zip(starts, ends)):
        rec = {
            "prompt_ids": torch.cat([prompt_ids, response_ids[:s]]),
            "response_ids": response_ids[s:e],
            "response_mask": response_mask[s:e],
            "anchor": observation_anchor(response_ids[ends[k - 1]:s] if k else torch.cat([prompt_ids, response_ids[:s]])),
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
    for k, call in enumerate(calls):
        _check_record(call, f"LLM call {k}")
        if call.get("prompt_ids") is None:
            raise StepExpansionError(f"LLM call {k} has no prompt_ids. Fix: record the prompt token ids of every "
                                     "LLM call.", field="prompt_ids")
        prompt = token_ids("prompt_ids", call["prompt_ids"], f"LLM call {k}").numpy()
        resp = token_ids("response_ids", call["response_ids"], f"LLM call {k}").numpy()
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
        if call.get("reward") is not None:
            rec["reward"] = call["reward"]  # the call's turn reward (validated where rows are built)
        if call.get("anchor") is not None:
            rec["anchor"] = call["anchor"]  # the agent loop's own anchor key (validated where rows are built)
        steps.append(rec)
        prev_full = np.concatenate([prompt, resp])
    return {"steps": steps}


def decode_step_records(records: Any) -> list[dict[str, Any]]:
    """Records (list, or ``{"steps": [...]}``, full or delta-encoded) -> list of full records."""
    records = _check_records(records, None) or []
    out: list[dict[str, Any]] = []
    prev_full: Optional[torch.Tensor] = None
    for k, rec in enumerate(records):
        where = f"step record {k}"
        resp = token_ids("response_ids", rec["response_ids"], where)
        if "prompt_ids" in rec and rec["prompt_ids"] is not None:
            prompt = token_ids("prompt_ids", rec["prompt_ids"], where)
            shared = 0 if prev_full is None else _common_prefix_len(prev_full.numpy(), prompt.numpy())
        elif "prompt_tail_ids" in rec:
            shared = checked_prefix_len(rec, where, 0 if prev_full is None else prev_full.numel())
            head = prev_full[:shared] if shared else torch.zeros(0, dtype=torch.long)
            prompt = torch.cat([head, token_ids("prompt_tail_ids", rec["prompt_tail_ids"], where)])
        else:
            raise StepExpansionError(f"step record {k} has neither prompt_ids nor prompt_tail_ids. Fix: record "
                                     "prompt_ids (or prompt_prefix_len + prompt_tail_ids).", field="prompt_ids")
        full = dict(rec)
        full["prompt_ids"] = prompt
        full["response_ids"] = resp
        if full.get("anchor") is None:  # the tokens this call saw since the previous one
            full["anchor"] = observation_anchor(observation_tokens(prompt, shared))
        out.append(full)
        prev_full = torch.cat([prompt, resp])
    return out


def _turn_reward(rec: Mapping[str, Any], n: int, b: int, k: int) -> torch.Tensor:
    """``[n]`` float: the record's own ``reward`` (a turn reward) on its last response token, 0 elsewhere."""
    out = torch.zeros(n)
    value = rec.get("reward")
    if value is None:
        return out
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) or not np.isfinite(value):
        raise StepExpansionError(f"row {b} step {k}: reward={value!r} is not a finite number. Fix: give each LLM call's "
                                 "turn reward as a float (or no reward key).", field="reward")
    if n == 0:
        raise StepExpansionError(f"row {b} step {k}: reward={value!r} on a call with no response token. Fix: drop "
                                 "the reward or record the call's tokens.", field="reward")
    out[-1] = float(value)
    return out


def _anchor_tokens(rec: Mapping[str, Any], tail: Optional[torch.Tensor], n: int, where: str) -> torch.Tensor:
    """``[n]`` int64: the call's anchor key (the record's own, else the hash of ``tail``, the tokens it saw since the
    previous call) on its first response token, 0 elsewhere."""
    out = torch.zeros(n, dtype=torch.long)
    value = rec.get("anchor")
    if value is None:
        value = observation_anchor(tail)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 < int(value) < 1 << 63:
        raise StepExpansionError(f"{where}: anchor={value!r} is not a positive 63-bit integer. Fix: give anchor keys "
                                 "through StepRecordingMixin.anchor_keys (any str / bytes / int / tuple: it hashes "
                                 "them).", field="anchor")
    if n:
        out[0] = int(value)
    return out


def _response_parts(rec: Mapping[str, Any], b: int, k: int, has_lp: bool, tail: Optional[torch.Tensor] = None):
    """(response ids, response mask, log-probs or None, turn reward per token, anchor per token) of one record,
    validated (``tail``: the tokens the call saw since the previous one, for its default anchor)."""
    where = f"row {b} step {k}"
    r = token_ids("response_ids", rec["response_ids"], where)
    m = checked_loss_mask(rec.get("response_mask"), where, r.numel())
    lp = None
    if has_lp:
        lp = rec.get("response_logprobs")
        if lp is None:
            raise StepExpansionError(
                f"{where}: the batch has rollout_log_probs but the step record has no response_logprobs. Fix: record "
                "the log-probs of every LLM call (or drop rollout_log_probs).", field="response_logprobs",
            )
        lp = checked_log_probs(lp, where, r.numel())
    return r, m, lp, _turn_reward(rec, r.numel(), b, k), _anchor_tokens(rec, tail, r.numel(), where)


def _merge_delta_encoded(steps: Sequence[Mapping[str, Any]], b: int, has_lp: bool):
    """Prefix merge straight from delta-encoded records (same result as decode + merge_trajectory_steps).

    Step k+1 continues step k's row iff its ``prompt_prefix_len`` equals step k's full context length
    (the common prefix is the whole previous context). Rows are built from response and tail segments.
    """
    n = len(steps)
    tails = [token_ids("prompt_tail_ids", rec["prompt_tail_ids"], f"row {b} step record {k}")
             for k, rec in enumerate(steps)]
    seen = tails  # what each call saw since the previous one; a call that saw nothing new: its whole context
    if any(t.numel() == 0 and rec.get("anchor") is None for t, rec in zip(tails, steps)):
        seen = [full["prompt_ids"] if tails[k].numel() == 0 else tails[k]
                for k, full in enumerate(decode_step_records(list(steps)))]
    parts = [_response_parts(rec, b, k, has_lp, seen[k]) for k, rec in enumerate(steps)]
    pre, full_len = [], []
    for k in range(n):
        pre.append(checked_prefix_len(steps[k], f"row {b} step record {k}", full_len[k - 1] if k else 0))
        full_len.append(pre[k] + tails[k].numel() + parts[k][0].numel())
    rows: list[MergedRow] = []
    names = [TURN_REWARD, STEP_ANCHOR] + (["lp"] if has_lp else [])
    row = RowBuilder(tails[0], 0, names)
    for k, (r, m, lp, rw, anchor) in enumerate(parts):
        values = {TURN_REWARD: rw, STEP_ANCHOR: anchor, **({"lp": lp} if has_lp else {})}
        if k and pre[k] == full_len[k - 1]:  # continues the current row
            row.add_observation(tails[k], m, values)
        elif k:
            context = row.full_context()
            rows.append(row.close(k - 1, len(rows), False))
            row = RowBuilder(torch.cat([context[: pre[k]], tails[k]]) if pre[k] else tails[k], k, names)
        row.add_response(r, m, values)
    rows.append(row.close(n - 1, len(rows), True))
    stats = MergeStats(rows_before=n, rows_after=len(rows), tokens_before=int(sum(full_len)),
                       tokens_after=sum(x.num_tokens for x in rows),
                       loss_tokens_before=int(sum(int(torch.count_nonzero(p[1])) for p in parts)),
                       loss_tokens_after=sum(int(torch.count_nonzero(x.response_mask)) for x in rows))
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


@dataclass
class _StepRows:
    """Step rows collected over the source rows, before padding into verl's layout."""

    prompts: list[torch.Tensor] = field(default_factory=list)
    responses: list[torch.Tensor] = field(default_factory=list)
    masks: list[torch.Tensor] = field(default_factory=list)
    log_probs: list[torch.Tensor] = field(default_factory=list)
    turn_rewards: list[torch.Tensor] = field(default_factory=list)
    anchors: list[torch.Tensor] = field(default_factory=list)
    source_row: list[int] = field(default_factory=list)
    source_steps: list[list[int]] = field(default_factory=list)
    step_index: list[int] = field(default_factory=list)
    is_last: list[bool] = field(default_factory=list)
    traj_ids: list[Any] = field(default_factory=list)
    stats: MergeStats = field(default_factory=MergeStats)

    def add(self, b: int, traj_id: Any, rows: list[MergedRow], has_lp: bool) -> None:
        for row in rows:
            self.prompts.append(row.prompt_ids)
            self.responses.append(row.response_ids)
            self.masks.append(row.response_mask)
            if has_lp:
                self.log_probs.append(row.per_token["lp"])
            self.turn_rewards.append(row.per_token[TURN_REWARD])
            self.anchors.append(row.per_token[STEP_ANCHOR])
            self.source_row.append(b)
            self.source_steps.append(row.source_steps)
            self.step_index.append(row.step_index)
            self.is_last.append(row.is_last_step)
            self.traj_ids.append(traj_id)


@dataclass(frozen=True)
class _Source:
    """The one-row-per-trajectory input, on CPU."""

    prompts: torch.Tensor  # [B, P]
    responses: torch.Tensor  # [B, R]
    attention_mask: torch.Tensor  # [B, P+R]
    response_mask: torch.Tensor  # [B, R]
    log_probs: Optional[torch.Tensor]  # [B, R] rollout log-probs, if any

    @property
    def has_lp(self) -> bool:
        return self.log_probs is not None


def _check_expandable(tensors: Mapping[str, torch.Tensor], non_tensors: Mapping[str, np.ndarray], drop: set) -> None:
    for key in ("prompts", "responses", "attention_mask", "response_mask"):
        if key not in tensors:
            raise StepExpansionError(f"tensor field {key!r} is missing. Fix: step expansion needs the rollout output's "
                                     "prompts, responses, attention_mask and response_mask.", field=key)
    pos = tensors.get("position_ids")
    if pos is not None and (not isinstance(pos, torch.Tensor) or pos.dim() != 2):
        raise StepExpansionError(
            f"position_ids has shape {tuple(getattr(pos, 'shape', ()))}: multi-dimensional (VLM M-RoPE) position ids "
            "are not supported with step-wise rows yet. Fix: use traj.step_wise=false for multi-modal models.",
            field="position_ids",
        )
    for key in _PER_TOKEN_UNSUPPORTED:
        if key in tensors and key not in drop:
            raise StepExpansionError(
                f"tensor field {key!r} is per token and cannot be re-derived for step rows. Fix: pass "
                f"drop_keys=[{key!r}] (e.g. disable router replay / distillation) or use traj.step_wise=false.",
                field=key,
            )
    mmi = non_tensors.get("multi_modal_inputs")
    if mmi is not None and "multi_modal_inputs" not in drop and any(x is not None and len(x) for x in mmi):
        raise StepExpansionError("multi_modal_inputs are not supported with step-wise rows yet. Fix: use "
                                 "traj.step_wise=false.", field="multi_modal_inputs")


def _source_rows(src: _Source, b: int, raw: Any, merge_prefix: bool) -> tuple[list[MergedRow], MergeStats]:
    """The (merged) step rows of source row ``b`` from its records, or cut from the row itself."""
    raw_steps = _check_records(raw, b)
    if merge_prefix and raw_steps is not None and len(raw_steps) and all(
        "prompt_tail_ids" in r and r.get("prompt_ids") is None for r in raw_steps
    ):
        # delta-encoded records decide every boundary from their prefix lengths: O(T) copies
        return _merge_delta_encoded(raw_steps, b, src.has_lp)
    with located(f"row {b}"):
        recs = decode_step_records(raw) if raw is not None else None
    if not recs:
        P = src.prompts.shape[1]
        pl, rl = int(src.attention_mask[b, :P].sum()), int(src.attention_mask[b, P:].sum())
        if int(src.attention_mask[b, P - pl:P + rl].sum()) != pl + rl:
            raise StepExpansionError.invalid(
                f"attention_mask[{b}]", src.attention_mask[b], "is not a left-padded prompt followed by a right-padded "
                "response (the row without step records is cut from its attended tokens)",
                "pass verl's layout, or record the row's LLM calls as step records")
        lp = src.log_probs[b, :rl] if src.has_lp else None
        recs = steps_from_row(src.prompts[b, P - pl:], src.responses[b, :rl], src.response_mask[b, :rl], lp)
    parts = [_response_parts(rec, b, k, src.has_lp) for k, rec in enumerate(recs)]
    return merge_trajectory_steps(
        [_as_long(rec["prompt_ids"]) for rec in recs], [p[0] for p in parts], [p[1] for p in parts],
        {TURN_REWARD: [p[3] for p in parts], STEP_ANCHOR: [p[4] for p in parts],
         **({"lp": [p[2] for p in parts]} if src.has_lp else {})},
        enable=merge_prefix,
    )


def _width(given: Optional[int], lens: torch.Tensor, name: str, multiple: int) -> int:
    longest = int(lens.max()) if lens.numel() else 0
    if given is None:
        mult = max(int(multiple), 1)
        return -(-max(longest, 1) // mult) * mult
    if longest > given:
        raise StepExpansionError(f"a step row has a {name} of {longest} tokens, above {name}_width={given}. Fix: raise "
                                 f"{name}_width or pass None (the longest step row).", field=f"{name}_width")
    return int(given)


def _layout_tensors(rows: _StepRows, src: _Source, widths: tuple[Optional[int], Optional[int]], multiple: int,
                    pad_token_id: int) -> dict[str, torch.Tensor]:
    """Step rows in verl's layout: left-padded prompts, right-padded responses, masks, 1-D positions."""
    p_lens = torch.tensor([p.numel() for p in rows.prompts], dtype=torch.long)
    r_lens = torch.tensor([r.numel() for r in rows.responses], dtype=torch.long)
    Pw, Rw = _width(widths[0], p_lens, "prompt", multiple), _width(widths[1], r_lens, "response", multiple)
    n = len(rows.prompts)
    new_prompts = _left_pad(rows.prompts, Pw, pad_token_id)
    new_resps = _right_pad(rows.responses, Rw, pad_token_id) if n else torch.zeros(0, Rw, dtype=torch.long)
    prompt_attn = (torch.arange(Pw).unsqueeze(0) >= (Pw - p_lens).unsqueeze(1)).long()
    resp_attn = (torch.arange(Rw).unsqueeze(0) < r_lens.unsqueeze(1)).long()
    attention_mask = torch.cat([prompt_attn, resp_attn], dim=1).to(src.attention_mask.dtype)
    mdt = src.response_mask.dtype
    new_mask = _right_pad([m.to(mdt) for m in rows.masks], Rw, 0) if n else torch.zeros(0, Rw, dtype=mdt)
    out = {
        "prompts": new_prompts.to(src.prompts.dtype),
        "responses": new_resps.to(src.responses.dtype),
        "input_ids": torch.cat([new_prompts, new_resps], dim=1).to(src.prompts.dtype),
        "attention_mask": attention_mask,
        "position_ids": pad_position_ids(attention_mask),
        "response_mask": new_mask * resp_attn.to(mdt),
    }
    if src.has_lp:
        out["rollout_log_probs"] = (_right_pad(rows.log_probs, Rw, 0.0) if n else torch.zeros(0, Rw)).to(src.log_probs.dtype)
    return out


def _outcome_on_last_rows(rm_scores: torch.Tensor, rows: _StepRows, out: dict[str, torch.Tensor]) -> torch.Tensor:
    """The trajectory's reward (source row's ``rm_scores`` sum) on its last step row's last response token."""
    n, Rw = out["responses"].shape
    rm = torch.zeros(n, Rw, dtype=rm_scores.dtype)
    last = torch.tensor(rows.is_last, dtype=torch.bool)
    pos = (out["attention_mask"][:, -Rw:].sum(-1) - 1).clamp(min=0)
    src = torch.tensor(rows.source_row, dtype=torch.long)
    rm[torch.arange(n)[last], pos[last]] = rm_scores.detach().cpu().float().sum(-1)[src[last]].to(rm.dtype)
    return rm


def _per_call_tensors(rows: _StepRows, width: int, step_anchors: bool) -> dict[str, torch.Tensor]:
    """``[B, R]`` per-call fields: the turn rewards where the agent loop gave any, the anchor keys when asked."""
    out = {}
    turn = _right_pad(rows.turn_rewards, width, 0.0) if rows.turn_rewards else None
    if turn is not None and bool(turn.any()):  # the agent loop gave turn rewards
        out[TURN_REWARDS] = turn
    if step_anchors:
        out[STEP_ANCHORS] = _right_pad(rows.anchors, width, 0) if rows.anchors else torch.zeros(0, width, dtype=torch.long)
    return out


def _carry_tensors(tensors: Mapping[str, torch.Tensor], src_index: torch.Tensor, drop: set, B: int, P: int,
                   R: int) -> dict[str, torch.Tensor]:
    """Per-row tensors (``[B]`` or ``[B, k]``) repeated onto every step row; per-token ones refused."""
    out = {}
    for key, value in tensors.items():
        if key in _REBUILT or key in drop:
            continue
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == B and (value.dim() == 1 or value.shape[1] not in (P, R, P + R)):
            out[key] = value.detach().cpu()[src_index]
        else:
            raise StepExpansionError(
                f"tensor field {key!r} with shape {tuple(getattr(value, 'shape', ()))} looks per-token; it cannot be "
                f"carried onto step rows. Fix: pass drop_keys=[{key!r}] or compute it after the expansion.", field=key,
            )
    return out


def _carry_non_tensors(non_tensors: Mapping[str, np.ndarray], rows: _StepRows, skip: set, B: int,
                       keys: tuple[str, str]) -> dict[str, np.ndarray]:
    """Per-row fields repeated onto every step row, plus the trajectory id, step index and last-step flag."""
    src = np.asarray(rows.source_row, dtype=np.int64)
    out = {}
    for key, value in non_tensors.items():
        if key in skip:
            continue
        try:
            arr = np.asarray(value)
        except (TypeError, ValueError) as exc:  # a ragged list
            raise StepExpansionError.invalid(key, value, f"is not an array ({exc})", "carry each non-tensor field as "
                                             "a numpy array of one entry per row (dtype=object)") from exc
        if arr.shape[:1] != (B,):
            raise StepExpansionError(f"non_tensor field {key!r} has shape {arr.shape}, expected [{B}, ...]. Fix: carry "
                                     "one entry per row.", field=key)
        out[key] = arr[src]
    traj_key, step_key = keys
    out[traj_key] = np.empty(len(rows.traj_ids), dtype=object)
    out[traj_key][:] = rows.traj_ids
    out[step_key] = np.asarray(rows.step_index, dtype=np.int64)
    out[IS_LAST_STEP] = np.asarray(rows.is_last, dtype=bool)
    return out


def _check_expand_inputs(tensors: Any, non_tensors: Any, steps_key: str, traj_id_key: str, options: tuple) -> set:
    """Every input of :func:`expand_step_rows` checked where it enters; returns the fields to drop."""
    for name, value in (("tensors", tensors), ("non_tensors", non_tensors)):
        if not isinstance(value, Mapping):
            raise StepExpansionError.invalid(name, value, "is not a mapping", f"pass {name} as {{name: column}}")
    check_expand_options(*options)
    drop = set(options[-1])
    _check_expandable(tensors, non_tensors, drop)
    check_source_tensors(tensors, non_tensors.get(steps_key), non_tensors.get(traj_id_key))
    return drop


def expand_step_rows(
    tensors: Mapping[str, torch.Tensor],
    non_tensors: Mapping[str, np.ndarray],
    *,
    steps_key: str = DEFAULT_STEPS_KEY,
    merge_prefix: bool = False,
    pad_token_id: int = 0,
    traj_id_key: str = "traj_id",
    step_index_key: str = "step_index",
    prompt_width: Optional[int] = None,
    response_width: Optional[int] = None,
    pad_to_multiple_of: int = 1,
    drop_keys: Sequence[str] = (),
    step_anchors: bool = False,
) -> ExpandedBatch:
    """Expand one-row-per-trajectory rollout output into step rows (optionally prefix-merged).

    Args:
        tensors: ``prompts`` [B, P] (left-padded), ``responses`` [B, R], ``attention_mask`` [B, P+R],
            ``response_mask`` [B, R]; optional ``rollout_log_probs`` and ``rm_scores`` [B, R]; other
            [B] / [B, k] per-row tensors are repeated.
        non_tensors: ``non_tensor_batch``; ``steps_key`` holds each row's step records (``None`` /
            missing: the row is cut with :func:`steps_from_row`); ``traj_id_key`` (if present and not
            None) names each row's trajectory, else ``"__row{b}"``.
        merge_prefix: merge consecutive steps whose context prefixes the next (``traj.merge_prefix``).
        pad_token_id: written into padding positions of ``prompts`` / ``responses`` / ``input_ids``.
        prompt_width / response_width: output widths (default: the longest step row, rounded up to
            ``pad_to_multiple_of``); a row longer than a given width raises.
        drop_keys: tensor / non-tensor fields to drop instead of carrying (e.g. ``routed_experts``).
        step_anchors: also write :data:`~verl_traj.core.keys.STEP_ANCHORS` ``[B, R]`` int64 (each call's anchor
            key on its first response token: GiGPO's step groups, :mod:`verl_traj.stepwise.step_groups`).

    Returns:
        :class:`ExpandedBatch` with ``traj_id_key``, ``step_index_key`` and ``is_last_step``
        (:data:`~verl_traj.core.keys.IS_LAST_STEP`) per row. Step rows are grouped by source row, in step order.
    """
    drop = _check_expand_inputs(tensors, non_tensors, steps_key, traj_id_key,
                                (pad_token_id, prompt_width, response_width, pad_to_multiple_of, drop_keys))
    lp = tensors.get("rollout_log_probs")
    src = _Source(*(tensors[k].detach().cpu() for k in ("prompts", "responses", "attention_mask", "response_mask")),
                  lp.detach().cpu() if lp is not None else None)
    (B, P), R = src.prompts.shape, src.responses.shape[1]
    records, traj_col = non_tensors.get(steps_key), non_tensors.get(traj_id_key)
    rows = _StepRows()
    for b in range(B):
        merged, stats = _source_rows(src, b, records[b] if records is not None else None, merge_prefix)
        rows.stats = rows.stats + stats
        rows.add(b, traj_col[b] if traj_col is not None and traj_col[b] is not None else f"__row{b}", merged, src.has_lp)
    out_t = _layout_tensors(rows, src, (prompt_width, response_width), pad_to_multiple_of, pad_token_id)
    if "rm_scores" in tensors:
        out_t["rm_scores"] = _outcome_on_last_rows(tensors["rm_scores"], rows, out_t)
    out_t.update(_per_call_tensors(rows, out_t["responses"].shape[1], step_anchors))
    src_index = torch.tensor(rows.source_row, dtype=torch.long)
    out_t.update(_carry_tensors(tensors, src_index, drop, B, P, R))
    skip = drop | {steps_key, traj_id_key, step_index_key, IS_LAST_STEP}
    out_nt = _carry_non_tensors(non_tensors, rows, skip, B, (traj_id_key, step_index_key))
    return ExpandedBatch(tensors=out_t, non_tensors=out_nt, source_row=src_index, source_steps=rows.source_steps,
                         stats=rows.stats)


def trajectory_step_rows(
    prompt_ids: Any,
    response_ids: Any,
    response_mask: Any,
    log_probs: Optional[Any],
    records: Any,
    *,
    merge_prefix: bool = False,
) -> tuple[list[MergedRow], MergeStats]:
    """The (merged) step rows of ONE trajectory, unpadded: its concatenated output (1-D prompt / response ids,
    response mask, optional rollout log-probs) and its step records (as :func:`expand_step_rows` reads them;
    ``None``: cut the output with :func:`steps_from_row`). Rows in step order; ``per_token["lp"]`` holds the
    log-probs when given."""
    where = "the trajectory's"
    prompt, response = token_ids("prompt_ids", prompt_ids, where), token_ids("response_ids", response_ids, where)
    mask = checked_loss_mask(response_mask, where, response.numel())
    lp = None if log_probs is None else checked_log_probs(log_probs, where, response.numel()).reshape(1, -1)
    src = _Source(prompt[None], response[None], torch.ones(1, prompt.numel() + response.numel(), dtype=torch.long),
                  mask[None], lp)
    return _source_rows(src, 0, records, merge_prefix)

