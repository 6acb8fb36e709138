"""The rows of a session whose calls form a tree (issue 56): the path decomposition of its call tree, prefix-merged.

A call continues its parent's row when it is its parent's first child (issue order) and its prompt extends the
parent's full context (``prompt_p + response_p``, the condition prefix merging reads); any other call starts a row of
its own, its prompt the row's masked prompt (a fork's later branch, a sub-agent's fresh context, a rewritten one).
Rows stay open while their branch goes on, so interleaved branches (sub-agent calls A1, B1, A2, B2) each become one
row. Every call's response is a loss span of exactly one row; a chain gives exactly
:func:`~verl_traj.stepwise.prefix_merge.merge_trajectory_steps`'s rows.

Every leaf ends a row (no call continues it). The session's ``is_last_step`` row is the one holding its last call in
issue order (always a leaf), ordered last: the row the session's own outcome sits on, one per session and its highest
step as the planner requires. Each
call's first response token carries its packed leaf span (:data:`~verl_traj.stepwise.flat_rows.TREE_CALL`,
:func:`~verl_traj.stepwise.call_tree.pack_leaf_span`) and, at a leaf with its own outcome, that outcome
(:data:`~verl_traj.stepwise.flat_rows.TREE_OUTCOME`): what the credit on a tree reads
(:mod:`verl_traj.stepwise.tree_credit`). Pure module (torch, numpy).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

from verl_traj.stepwise.call_tree import call_tree, pack_leaf_span, unpack_leaf_span
from verl_traj.stepwise.expand_inputs import StepExpansionError
from verl_traj.stepwise.flat_rows import STEP_ANCHOR, TREE_CALL, TREE_OUTCOME, TURN_REWARD
from verl_traj.stepwise.prefix_merge import MergedRow, MergeStats, RowBuilder, extends_context

__all__ = ["tree_merged_rows", "tree_session_rows"]


def tree_merged_rows(prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor],
                     masks: Sequence[torch.Tensor], parents: Sequence[int],
                     per_token: Optional[Mapping[str, Sequence[torch.Tensor]]] = None,
                     merge: bool = True) -> list[MergedRow]:
    """``C`` calls in issue order (1-D ``prompts`` / ``responses`` / ``masks``, ``parents`` ``[C]``, per-token values
    ``[C]`` lists of ``[len(response)]``) -> the session's rows, ordered by their first call but for the one holding
    the last call, which comes last (module docstring;
    ``merge=False``, ``traj.merge_prefix=false``: one row per call)."""
    tree = call_tree(np.asarray(parents, dtype=np.int64))
    names = list(per_token or {})
    open_rows: list[RowBuilder] = []
    calls_of: list[list[int]] = []
    row_of = np.full(tree.num_calls, -1, dtype=np.int64)
    for k in range(tree.num_calls):
        p = int(tree.parent[k])
        values = {n: per_token[n][k] for n in names}
        if merge and p >= 0 and tree.first_child[k] and extends_context(prompts[p], responses[p], prompts[k]):
            row = int(row_of[p])
            tail = prompts[k][prompts[p].numel() + responses[p].numel():]
            open_rows[row].add_observation(tail, masks[k], values)
        else:
            row = len(open_rows)
            open_rows.append(RowBuilder(prompts[k], k, names))
            calls_of.append([])
        open_rows[row].add_response(responses[k], masks[k], values)
        calls_of[row].append(k)
        row_of[k] = row
    last = int(row_of[-1])  # the row with the session's last call goes last: the planner reads it as the last step
    order = [r for r in range(len(open_rows)) if r != last] + [last]
    out = []
    for index, r in enumerate(order):
        row = open_rows[r].close(calls_of[r][-1], index, r == last)
        row.source_steps = list(calls_of[r])
        out.append(row)
    return out


def _leaf_outcomes(recs: Sequence[Mapping[str, Any]], is_leaf: np.ndarray, where: str) -> np.ndarray:
    """``[C]`` float64 each call's own ``outcome`` (NaN where it has none), checked: only leaves, finite numbers."""
    out = np.full(len(recs), np.nan)
    for k, rec in enumerate(recs):
        value = rec.get("outcome")
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) \
                or not np.isfinite(value) or not is_leaf[k]:
            what = "not a finite number" if is_leaf[k] else "on a call that other calls continue (not a leaf)"
            raise StepExpansionError(f"{where} call {k}: outcome={value!r} is {what}. Fix: give each leaf's own "
                                     "outcome as a float through StepRecordingMixin.leaf_rewards (None elsewhere).",
                                     field="outcome")
        out[k] = float(value)
    return out


def _tree_values(recs, parts, tree, where: str) -> dict[str, list[torch.Tensor]]:
    """The tree's per-token fields of each call: its packed leaf span and own outcome on its first response token."""
    lo, hi = tree.leaf_spans()
    outcome = _leaf_outcomes(recs, tree.is_leaf, where)
    own = ~np.isnan(outcome)
    keys = pack_leaf_span(lo, hi, own)
    calls, outcomes = [], []
    for k, part in enumerate(parts):
        n = part[0].numel()
        if n == 0 and own[k]:
            raise StepExpansionError(f"{where} call {k}: a leaf with its own outcome has no response token to carry "
                                     "it. Fix: record the call's tokens, or give no outcome.", field="outcome")
        if recs[k].get("reward") is not None:
            raise StepExpansionError(
                f"{where} call {k}: a turn reward (the record's 'reward') in a branching session: returns on a tree "
                "are not wired into the trainers yet. Fix: give the session's reward as its outcome (or each leaf's "
                "through leaf_rewards) and no per-call rewards, or record the session as one chain.", field="reward")
        call, value = torch.zeros(n, dtype=torch.long), torch.zeros(n)
        if n:
            call[0], value[0] = int(keys[k]), float(outcome[k]) if own[k] else 0.0
        calls.append(call)
        outcomes.append(value)
    return {TREE_CALL: calls, TREE_OUTCOME: outcomes}


def _path_rows(prompts, parts, per_token, tree, merge: bool) -> list[MergedRow]:
    """``traj.branch_weighting=paths`` (what the peers train): every root-to-leaf path its own chain of rows, each
    copy of a call spanning only its path's leaf; the last path's last row is the session's last."""
    lo, hi = tree.leaf_spans()
    leaf_of = {int(lo[c]): c for c in np.flatnonzero(tree.is_leaf)}
    rows: list[MergedRow] = []
    for leaf_index in range(len(leaf_of)):
        path, c = [], leaf_of[leaf_index]
        while c >= 0:
            path.append(c)
            c = int(tree.parent[c])
        path.reverse()
        values = {name: [v[k] for k in path] for name, v in per_token.items()}
        own = [int(unpack_leaf_span(v[0])[2]) if v.numel() else 0 for v in values[TREE_CALL]]
        values[TREE_CALL] = [torch.where(v != 0, int(pack_leaf_span(leaf_index, leaf_index + 1, o)), 0)
                             for v, o in zip(values[TREE_CALL], own)]
        chain = tree_merged_rows([prompts[k] for k in path], [parts[k][0] for k in path],
                                 [parts[k][1] for k in path], list(range(-1, len(path) - 1)), values, merge)
        for row in chain:
            row.source_steps = [path[i] for i in row.source_steps]
            row.is_last_step, row.step_index = False, len(rows)
            rows.append(row)
    rows[-1].is_last_step = True
    return rows


def tree_session_rows(recs: Sequence[Mapping[str, Any]], parts: Sequence[tuple], has_lp: bool, merge: bool,
                      where: str, paths: bool = False) -> tuple[list[MergedRow], MergeStats]:
    """A branching session's rows from its decoded records (full ``prompt_ids``, ``parent``) and each call's
    validated response parts (``(ids, mask, log-probs or None, turn reward, anchor)``, as the expansion builds them),
    with the tree's fields; ``paths``: one chain of rows per root-to-leaf path instead (:func:`_path_rows`)."""
    tree = call_tree([int(r["parent"]) for r in recs])
    per_token = {TURN_REWARD: [p[3] for p in parts], STEP_ANCHOR: [p[4] for p in parts],
                 **({"lp": [p[2] for p in parts]} if has_lp else {})}
    per_token.update(_tree_values(recs, parts, tree, where))
    prompts = [r["prompt_ids"] for r in recs]
    if paths:
        rows = _path_rows(prompts, parts, per_token, tree, merge)
    else:
        rows = tree_merged_rows(prompts, [p[0] for p in parts], [p[1] for p in parts], tree.parent.tolist(),
                                per_token, merge)
    loss = sum(int(torch.count_nonzero(p[1])) for p in parts)
    stats = MergeStats(rows_before=len(recs), rows_after=len(rows),
                       tokens_before=sum(int(q.numel() + p[0].numel()) for q, p in zip(prompts, parts)),
                       tokens_after=sum(r.num_tokens for r in rows), loss_tokens_before=loss,
                       loss_tokens_after=sum(int(torch.count_nonzero(r.response_mask)) for r in rows))
    return rows, stats
