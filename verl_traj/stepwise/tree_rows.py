"""The rows of a session whose calls form a tree (issue 56): the path decomposition of its call tree, prefix-merged.

A call continues its parent's row when it is its parent's first child (issue order) and its prompt extends the
parent's full context (``prompt_p + response_p``, the condition prefix merging reads); any other call starts a row of
its own, its prompt the row's masked prompt (a fork's later branch, a sub-agent's fresh context, a rewritten one).
Rows stay open while their branch goes on, so interleaved branches (sub-agent calls A1, B1, A2, B2) each become one
row. Every call's response is a loss span of exactly one row; a chain gives exactly
:func:`~verl_traj.stepwise.prefix_merge.merge_trajectory_steps`'s rows.

Provisional (credit on a tree is not wired yet): a row's ``is_last_step`` says its last call is a leaf, where a
root-to-leaf path ends. Pure module (torch, numpy).
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np
import torch

from verl_traj.stepwise.call_tree import call_tree
from verl_traj.stepwise.prefix_merge import MergedRow, RowBuilder, extends_context

__all__ = ["tree_merged_rows"]


def tree_merged_rows(prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor],
                     masks: Sequence[torch.Tensor], parents: Sequence[int],
                     per_token: Optional[Mapping[str, Sequence[torch.Tensor]]] = None) -> list[MergedRow]:
    """``C`` calls in issue order (1-D ``prompts`` / ``responses`` / ``masks``, ``parents`` ``[C]``, per-token values
    ``[C]`` lists of ``[len(response)]``) -> the session's rows, ordered by their first call (module docstring)."""
    tree = call_tree(np.asarray(parents, dtype=np.int64))
    names = list(per_token or {})
    open_rows: list[RowBuilder] = []
    calls_of: list[list[int]] = []
    row_of = np.full(tree.num_calls, -1, dtype=np.int64)
    for k in range(tree.num_calls):
        p = int(tree.parent[k])
        values = {n: per_token[n][k] for n in names}
        if p >= 0 and tree.first_child[k] and extends_context(prompts[p], responses[p], prompts[k]):
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
    out = []
    for index, (builder, calls) in enumerate(zip(open_rows, calls_of)):
        row = builder.close(calls[-1], index, bool(tree.is_leaf[calls[-1]]))
        row.source_steps = list(calls)
        out.append(row)
    return out
