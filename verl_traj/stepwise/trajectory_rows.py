"""The step rows of one trajectory, from its records (or cut from its concatenated row): the per-trajectory path of
the step-row expansion (:mod:`verl_traj.stepwise.expand`), and v1's agent-loop worker's one path.

Every record is validated where it is read (each refusal a :class:`StepExpansionError` naming the row, the step and
the field); the rows are prefix-merged (:mod:`verl_traj.stepwise.prefix_merge`) when asked. Whole chains of a v0
batch take the vectorised path (:mod:`verl_traj.stepwise.chains`), whose rows equal these.

Pure module: torch, numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

from verl_traj.stepwise.anchors import observation_anchor
from verl_traj.stepwise.expand_inputs import (StepExpansionError, checked_log_probs, checked_loss_mask,
                                              checked_prefix_len, located, token_ids)
from verl_traj.stepwise.flat_rows import STEP_ANCHOR, TURN_REWARD
from verl_traj.stepwise.prefix_merge import MergedRow, MergeStats, RowBuilder, merge_trajectory_steps
from verl_traj.stepwise.records import as_long, check_records, decode_step_records, steps_from_row
from verl_traj.stepwise.tree_rows import tree_session_rows

__all__ = ["Source", "source_rows", "trajectory_step_rows"]


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


@dataclass(frozen=True)
class Source:
    """The one-row-per-trajectory input, on CPU."""

    prompts: torch.Tensor  # [B, P]
    responses: torch.Tensor  # [B, R]
    attention_mask: torch.Tensor  # [B, P+R]
    response_mask: torch.Tensor  # [B, R]
    log_probs: Optional[torch.Tensor]  # [B, R] rollout log-probs, if any

    @property
    def has_lp(self) -> bool:
        return self.log_probs is not None


def source_rows(src: Source, b: int, raw: Any, merge_prefix: bool,
                branch_paths: bool = False) -> tuple[list[MergedRow], MergeStats]:
    """The (merged) step rows of source row ``b`` from its records, or cut from the row itself (``branch_paths``: a
    branching session as one chain of rows per root-to-leaf path, ``traj.branch_weighting=paths``)."""
    raw_steps = check_records(raw, b)
    if raw_steps and any(r.get("parent", k - 1) != k - 1 or r.get("outcome") is not None
                         for k, r in enumerate(raw_steps)):  # a branching session, or a leaf's own outcome
        with located(f"row {b}"):
            recs = decode_step_records(raw)
        parts = [_response_parts(rec, b, k, src.has_lp) for k, rec in enumerate(recs)]
        return tree_session_rows(recs, parts, src.has_lp, merge_prefix, f"row {b}", branch_paths)
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
        [as_long(rec["prompt_ids"]) for rec in recs], [p[0] for p in parts], [p[1] for p in parts],
        {TURN_REWARD: [p[3] for p in parts], STEP_ANCHOR: [p[4] for p in parts],
         **({"lp": [p[2] for p in parts]} if src.has_lp else {})},
        enable=merge_prefix,
    )


def trajectory_step_rows(
    prompt_ids: Any,
    response_ids: Any,
    response_mask: Any,
    log_probs: Optional[Any],
    records: Any,
    *,
    merge_prefix: bool = False,
    branch_paths: bool = False,
) -> tuple[list[MergedRow], MergeStats]:
    """The (merged) step rows of ONE trajectory, unpadded: its concatenated output (1-D prompt / response ids,
    response mask, optional rollout log-probs) and its step records (as :func:`expand_step_rows` reads them;
    ``None``: cut the output with :func:`steps_from_row`). Rows in step order; ``per_token["lp"]`` holds the
    log-probs when given."""
    where = "the trajectory's"
    prompt, response = token_ids("prompt_ids", prompt_ids, where), token_ids("response_ids", response_ids, where)
    mask = checked_loss_mask(response_mask, where, response.numel())
    lp = None if log_probs is None else checked_log_probs(log_probs, where, response.numel()).reshape(1, -1)
    src = Source(prompt[None], response[None], torch.ones(1, prompt.numel() + response.numel(), dtype=torch.long),
                  mask[None], lp)
    return source_rows(src, 0, records, merge_prefix, branch_paths)
