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

Where the records live: :mod:`verl_traj.stepwise.records` (the codec), :mod:`verl_traj.stepwise.trajectory_rows` (one
trajectory's rows, validated record by record). Whole chains (delta-encoded, every context extending the previous
one: what the step-recording agent loop sends) are expanded for the whole batch at once
(:mod:`verl_traj.stepwise.chains`); every other row goes through the per-trajectory path. The rows are held flat
and padded with index arithmetic (:mod:`verl_traj.stepwise.flat_rows`): no Python loop over rows or tokens but the
one over the rows outside whole chains, and the list comprehensions that read the records (Python objects).

Pure module: torch, numpy, stdlib.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

from verl_traj.core.keys import IS_LAST_STEP, STEP_ANCHORS, TREE_CALLS, TREE_OUTCOMES, TURN_REWARDS
from verl_traj.stepwise.chains import chain_rows
from verl_traj.stepwise.expand_inputs import StepExpansionError, check_expand_options, check_source_tensors
from verl_traj.stepwise.flat_rows import FlatRows, cat_rows, filled, from_merged_rows, padded, row_index_array
from verl_traj.stepwise.flat_rows import STEP_ANCHOR, TURN_REWARD  # noqa: F401  (v1's agent-loop worker reads them here)
from verl_traj.stepwise.prefix_merge import MergeStats
from verl_traj.stepwise.records import decode_step_records, encode_step_records, steps_from_row
from verl_traj.stepwise.trajectory_rows import Source, source_rows, trajectory_step_rows

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
# Tensor fields rebuilt by the expansion.
_REBUILT = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask",
            "rollout_log_probs", "rm_scores")
# Per-token tensors that cannot be re-derived for step rows.
_PER_TOKEN_UNSUPPORTED = ("routed_experts", "teacher_logprobs", "teacher_ids")


@dataclass
class ExpandedBatch:
    """Output of :func:`expand_step_rows`.

    Attributes:
        tensors: name -> [B', ...] tensors (verl's layout, see module docstring).
        non_tensors: name -> np.ndarray [B'] (object / int / bool).
        source_row: LongTensor [B']: the input row each step row came from.
        step_span: LongTensor [B', 2]: the first and last record index merged into each row
            (:attr:`source_steps` lists them).
        stats: rows / tokens / loss tokens before and after merging (before = one row per step).
    """

    tensors: dict[str, torch.Tensor]
    non_tensors: dict[str, np.ndarray]
    source_row: torch.Tensor
    step_span: torch.Tensor
    stats: MergeStats

    @property
    def source_steps(self) -> list[list[int]]:
        """Per row, the record indices merged into it (built on access: a list per row)."""
        return [list(range(a, b + 1)) for a, b in self.step_span.tolist()]

    def metrics(self, prefix: str = "traj_stepwise") -> dict[str, float]:
        out = self.stats.metrics(prefix)
        out[f"{prefix}/trajectories"] = float(len(torch.unique(self.source_row))) if self.source_row.numel() else 0.0
        return out


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


def _width(given: Optional[int], lens: torch.Tensor, name: str, multiple: int) -> int:
    longest = int(lens.max()) if lens.numel() else 0
    if given is None:
        mult = max(int(multiple), 1)
        return -(-max(longest, 1) // mult) * mult
    if longest > given:
        raise StepExpansionError(f"a step row has a {name} of {longest} tokens, above {name}_width={given}. Fix: raise "
                                 f"{name}_width or pass None (the longest step row).", field=f"{name}_width")
    return int(given)


def _layout_tensors(rows: FlatRows, src: Source, widths: tuple[Optional[int], Optional[int]], multiple: int,
                    pad_token_id: int) -> dict[str, torch.Tensor]:
    """Step rows in verl's layout: left-padded prompts, right-padded responses, masks, 1-D positions."""
    p_lens, r_lens = rows.prompt_len, rows.response_len
    Pw, Rw = _width(widths[0], p_lens, "prompt", multiple), _width(widths[1], r_lens, "response", multiple)
    prompt_attn, resp_attn = filled(p_lens, Pw, left=True), filled(r_lens, Rw, left=False)
    new_prompts = padded(rows.prompt, p_lens, Pw, left=True, fill=pad_token_id, where=prompt_attn)
    new_resps = padded(rows.response, r_lens, Rw, left=False, fill=pad_token_id, where=resp_attn)
    attention_mask = torch.cat([prompt_attn, resp_attn], dim=1).to(src.attention_mask.dtype)
    # verl's clip(cumsum(mask) - 1, min=0) on a contiguous attended span: 0 before it, its last position after it
    last = (p_lens + r_lens - 1).clamp(min=0).unsqueeze(1)
    position_ids = torch.arange(Pw + Rw).unsqueeze(0) - (Pw - p_lens).unsqueeze(1)
    out = {
        "prompts": new_prompts.to(src.prompts.dtype),
        "responses": new_resps.to(src.responses.dtype),
        "input_ids": torch.cat([new_prompts, new_resps], dim=1).to(src.prompts.dtype),
        "attention_mask": attention_mask,
        "position_ids": torch.minimum(position_ids.clamp_(min=0), last, out=position_ids),
        "response_mask": padded(rows.mask, r_lens, Rw, left=False, dtype=src.response_mask.dtype, where=resp_attn),
    }
    if src.has_lp:
        out["rollout_log_probs"] = padded(rows.log_probs, r_lens, Rw, left=False, fill=0.0, dtype=src.log_probs.dtype,
                                          where=resp_attn)
    return out


def _outcome_on_last_rows(rm_scores: torch.Tensor, rows: FlatRows, out: dict[str, torch.Tensor]) -> torch.Tensor:
    """The trajectory's reward (source row's ``rm_scores`` sum) on its last step row's last response token."""
    n, Rw = out["responses"].shape
    rm = torch.zeros(n, Rw, dtype=rm_scores.dtype)
    last = rows.is_last
    pos = (rows.response_len - 1).clamp(min=0)
    rm[torch.arange(n)[last], pos[last]] = rm_scores.detach().cpu().float().sum(-1)[rows.source_row[last]].to(rm.dtype)
    return rm


def _per_call_tensors(rows: FlatRows, width: int, step_anchors: bool) -> dict[str, torch.Tensor]:
    """``[B, R]`` per-call fields: the turn rewards where the agent loop gave any, the anchor keys when asked, a
    branching session's tree fields where the batch has one."""
    out = {}
    if bool(rows.turn_reward.any()):  # the agent loop gave turn rewards
        out[TURN_REWARDS] = padded(rows.turn_reward, rows.response_len, width, left=False, fill=0.0)
    if step_anchors:
        out[STEP_ANCHORS] = padded(rows.anchor, rows.response_len, width, left=False)
    if rows.tree_call is not None:  # a branching session's leaf spans and leaves' own outcomes (issue 56)
        out[TREE_CALLS] = padded(rows.tree_call, rows.response_len, width, left=False)
        out[TREE_OUTCOMES] = padded(rows.tree_outcome, rows.response_len, width, left=False, fill=0.0)
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


def _carry_non_tensors(non_tensors: Mapping[str, np.ndarray], rows: FlatRows, traj_ids: Sequence, skip: set,
                       B: int, keys: tuple[str, str]) -> dict[str, np.ndarray]:
    """Per-row fields repeated onto every step row, plus the trajectory id (``traj_ids``: one per source row), step
    index and last-step flag."""
    src = rows.source_row.numpy()
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
    out[traj_key] = row_index_array(traj_ids, rows.source_row)
    out[step_key] = rows.step_index.numpy().astype(np.int64)
    out[IS_LAST_STEP] = rows.is_last.numpy().astype(bool)
    return out


def _step_rows(src: Source, records: Any, merge_prefix: bool, anchors: bool,
               branch_paths: bool = False) -> tuple[FlatRows, MergeStats]:
    """Every source row's (merged) step rows, grouped by source row in step order: whole chains vectorised
    (:mod:`verl_traj.stepwise.chains`), any other row by the per-trajectory path (:func:`source_rows`)."""
    B = src.prompts.shape[0]
    rest = np.arange(B, dtype=np.int64)
    fast, stats = None, MergeStats()
    if records is not None:
        fast, stats, rest = chain_rows(records, rest, has_lp=src.has_lp, merge=merge_prefix, anchors=anchors)
    slow = []
    for b in rest.tolist():  # rows outside whole chains (no records, partial merges, full prompts, bad input)
        merged, row_stats = source_rows(src, b, records[b] if records is not None else None, merge_prefix,
                                        branch_paths)
        stats = stats + row_stats
        slow += [(b, row) for row in merged]
    parts = [fast] + ([from_merged_rows(slow, src.has_lp, anchors)] if slow or fast is None else [])
    return cat_rows(parts).in_source_order(), stats


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
    branch_paths: bool = False,
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
        branch_paths: a branching session as one chain of rows per root-to-leaf path (``traj.branch_weighting=paths``,
            what the peers train) instead of its call tree's rows.

    Returns:
        :class:`ExpandedBatch` with ``traj_id_key``, ``step_index_key`` and ``is_last_step``
        (:data:`~verl_traj.core.keys.IS_LAST_STEP`) per row. Step rows are grouped by source row, in step order.
    """
    drop = _check_expand_inputs(tensors, non_tensors, steps_key, traj_id_key,
                                (pad_token_id, prompt_width, response_width, pad_to_multiple_of, drop_keys))
    lp = tensors.get("rollout_log_probs")
    src = Source(*(tensors[k].detach().cpu() for k in ("prompts", "responses", "attention_mask", "response_mask")),
                  lp.detach().cpu() if lp is not None else None)
    (B, P), R = src.prompts.shape, src.responses.shape[1]
    records, traj_col = non_tensors.get(steps_key), non_tensors.get(traj_id_key)
    rows, stats = _step_rows(src, records, merge_prefix, step_anchors, branch_paths)
    out_t = _layout_tensors(rows, src, (prompt_width, response_width), pad_to_multiple_of, pad_token_id)
    if "rm_scores" in tensors:
        out_t["rm_scores"] = _outcome_on_last_rows(tensors["rm_scores"], rows, out_t)
    out_t.update(_per_call_tensors(rows, out_t["responses"].shape[1], step_anchors))
    out_t.update(_carry_tensors(tensors, rows.source_row, drop, B, P, R))
    skip = drop | {steps_key, traj_id_key, step_index_key, IS_LAST_STEP}
    traj_ids = [t if t is not None else f"__row{b}" for b, t in enumerate(traj_col)] if traj_col is not None else \
        [f"__row{b}" for b in range(B)]
    out_nt = _carry_non_tensors(non_tensors, rows, traj_ids, skip, B, (traj_id_key, step_index_key))
    return ExpandedBatch(tensors=out_t, non_tensors=out_nt, source_row=rows.source_row,
                         step_span=torch.stack([rows.first_step, rows.last_step], 1), stats=stats)
