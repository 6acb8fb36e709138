"""Step records: what the step-wise agent loop sends for each LLM call, and their codec.

A record is a mapping with ``prompt_ids`` and ``response_ids`` (lists, arrays or 1-D tensors) and optional
``response_mask``, ``response_logprobs``, ``reward`` (a turn reward) and ``anchor`` (GiGPO's key). To keep the
rollout -> trainer transfer O(T) instead of O(T^2), a record may instead give ``prompt_prefix_len`` +
``prompt_tail_ids``: its prompt is the first ``prompt_prefix_len`` tokens of the previous step's prompt+response
followed by the tail (:func:`encode_step_records` builds this form, :func:`decode_step_records` undoes it). A row's
records may be a list, or a dict ``{"steps": [...]}``. Rows without records are cut at the runs of
``response_mask == 1`` (:func:`steps_from_row`).

Pure module: torch, numpy.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

from verl_traj.stepwise.anchors import observation_anchor, observation_tokens
from verl_traj.stepwise.expand_inputs import StepExpansionError, checked_prefix_len, token_ids

__all__ = ["as_long", "check_record", "check_records", "decode_step_records", "encode_step_records", "steps_from_row"]


def check_record(rec: Any, where: str) -> None:
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


def check_records(records: Any, b: Optional[int]) -> Any:
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
        check_record(rec, f"{row}step record {k}")
    return steps

def as_long(x: Any) -> torch.Tensor:
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


def call_parent(rec: Mapping[str, Any], k: int, where: str) -> int:
    """Call ``k``'s parent: the record's ``parent`` (an earlier call whose prompt and response its prompt extends, or
    -1 for a fresh context), default the previous call (-1 for the first). Raises naming the field."""
    parent = rec.get("parent", k - 1)
    if isinstance(parent, bool) or not isinstance(parent, (int, np.integer)) or not -1 <= int(parent) < k:
        raise StepExpansionError(
            f"{where} names parent {parent!r}: a call's parent is an earlier call of its session (0..{k - 1}) or -1 "
            "for a fresh context. Fix: record parent as the index, in issue order, of the call this one continues.",
            field="parent")
    return int(parent)


def encode_step_records(calls: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Compact per-call records (prompt delta-encoded against its parent's full context: the previous call's unless
    the call names another ``parent``, issue 56).

    ``calls``: per LLM call, ``prompt_ids`` and ``response_ids`` (and optional ``response_logprobs``,
    ``response_mask``, ``parent``). Returns ``{"steps": [...]}`` with int32/float32 numpy arrays; a record names its
    ``parent`` only where it is not the previous call (a chain encodes as before).
    """
    steps = []
    fulls: list[np.ndarray] = []
    for k, call in enumerate(calls):
        check_record(call, f"LLM call {k}")
        if call.get("prompt_ids") is None:
            raise StepExpansionError(f"LLM call {k} has no prompt_ids. Fix: record the prompt token ids of every "
                                     "LLM call.", field="prompt_ids")
        prompt = token_ids("prompt_ids", call["prompt_ids"], f"LLM call {k}").numpy()
        resp = token_ids("response_ids", call["response_ids"], f"LLM call {k}").numpy()
        parent = call_parent(call, k, f"LLM call {k}")
        shared = _common_prefix_len(fulls[parent], prompt) if parent >= 0 else 0
        rec: dict[str, Any] = {
            "prompt_prefix_len": shared,
            "prompt_tail_ids": prompt[shared:].astype(np.int32),
            "response_ids": resp.astype(np.int32),
            **({"parent": parent} if parent != k - 1 else {}),
        }
        if call.get("response_logprobs") is not None:
            rec["response_logprobs"] = np.asarray(call["response_logprobs"], dtype=np.float32).reshape(-1)
        if call.get("response_mask") is not None:
            rec["response_mask"] = np.asarray(call["response_mask"], dtype=np.int8).reshape(-1)
        if call.get("reward") is not None:
            rec["reward"] = call["reward"]  # the call's turn reward (validated where rows are built)
        if call.get("outcome") is not None:
            rec["outcome"] = float(call["outcome"])  # a leaf's own outcome (a branching session, issue 56)
        if call.get("anchor") is not None:
            rec["anchor"] = call["anchor"]  # the agent loop's own anchor key (validated where rows are built)
        elif shared < prompt.size:  # GiGPO's default key, hashed here once where the call is recorded (the driver
            rec["anchor"] = observation_anchor(rec["prompt_tail_ids"])  # would hash every call of a step again)
        steps.append(rec)
        fulls.append(np.concatenate([prompt, resp]))
    return {"steps": steps}


def decode_step_records(records: Any) -> list[dict[str, Any]]:
    """Records (list, or ``{"steps": [...]}``, full or delta-encoded) -> list of full records."""
    records = check_records(records, None) or []
    out: list[dict[str, Any]] = []
    fulls: list[torch.Tensor] = []
    for k, rec in enumerate(records):
        where = f"step record {k}"
        resp = token_ids("response_ids", rec["response_ids"], where)
        parent = call_parent(rec, k, where)
        base = fulls[parent] if parent >= 0 else None  # the context this call continues (delta-encoded against it)
        if "prompt_ids" in rec and rec["prompt_ids"] is not None:
            prompt = token_ids("prompt_ids", rec["prompt_ids"], where)
            shared = 0 if base is None else _common_prefix_len(base.numpy(), prompt.numpy())
        elif "prompt_tail_ids" in rec:
            shared = checked_prefix_len(rec, where, 0 if base is None else base.numel())
            head = base[:shared] if shared else torch.zeros(0, dtype=torch.long)
            prompt = torch.cat([head, token_ids("prompt_tail_ids", rec["prompt_tail_ids"], where)])
        else:
            raise StepExpansionError(f"step record {k} has neither prompt_ids nor prompt_tail_ids. Fix: record "
                                     "prompt_ids (or prompt_prefix_len + prompt_tail_ids).", field="prompt_ids")
        full = dict(rec)
        full["prompt_ids"] = prompt
        full["response_ids"] = resp
        full["parent"] = parent
        if full.get("anchor") is None:  # the tokens this call saw since its parent (siblings share their state's)
            full["anchor"] = observation_anchor(observation_tokens(prompt, shared))
        out.append(full)
        fulls.append(torch.cat([prompt, resp]))
    return out
