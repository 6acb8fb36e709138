"""Branching sessions for tests and benchmarks (issue 56): random call trees with token contexts, as the step-recording
agent loop records them, in verl's batch layout.

A session's calls are issued in order; each names an earlier call it continues (its prompt that call's full context
plus an observation) or starts a fresh context (a sub-agent, a condensation). Every response token id is unique in
the batch (``first_token`` upward), so a test maps each loss token of the planned rows back to its call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from verl_traj.stepwise.records import encode_step_records

__all__ = ["BranchingSession", "branching_batch", "branching_session", "leaves_below"]


@dataclass
class BranchingSession:
    """One session: ``parent`` ``[C]`` (-1: a fresh context), each call's ``prompt`` / ``response`` token lists and
    rollout ``log_probs``, each leaf's own ``outcome`` (``None`` everywhere: the session's reward on every leaf), and
    its step records (:func:`~verl_traj.stepwise.records.encode_step_records`)."""

    parent: list[int]
    prompt: list[list[int]]
    response: list[list[int]]
    log_probs: list[list[float]]
    outcome: list[Optional[float]]
    records: dict

    @property
    def is_leaf(self) -> list[bool]:
        below = set(p for p in self.parent if p >= 0)
        return [c not in below for c in range(len(self.parent))]

    def paths(self) -> list[list[int]]:
        """Every root-to-leaf path (calls in order), leaves in depth-first order."""
        kids = {c: [k for k, p in enumerate(self.parent) if p == c] for c in range(len(self.parent))}

        def walk(c: int) -> list[list[int]]:
            return [[c]] if not kids[c] else [[c] + rest for k in kids[c] for rest in walk(k)]

        return [path for root, p in enumerate(self.parent) if p < 0 for path in walk(root)]


def leaves_below(session: BranchingSession) -> list[list[int]]:
    """Each call's leaves (the last call of every path through it)."""
    out: list[list[int]] = [[] for _ in session.parent]
    for path in session.paths():
        for c in path:
            out[c].append(path[-1])
    return out


def branching_session(rng: np.random.Generator, n_calls: int, first_token: int, *, prompt: Optional[list] = None,
                      fork: float = 0.35, fresh: float = 0.15, leaf_outcomes: bool = False) -> BranchingSession:
    """A random session of ``n_calls`` calls (module docstring): a call forks from a random earlier call with
    probability ``fork``, starts a fresh context with ``fresh``, else continues the previous call. ``prompt``: the
    first call's context (a GRPO group's shared prompt); ``leaf_outcomes``: every leaf gets an own outcome in [0, 1]."""
    base = list(prompt) if prompt is not None else rng.integers(1, 100, int(rng.integers(2, 5))).tolist()
    parent, prompts, responses, lps, token = [], [], [], [], first_token
    for k in range(n_calls):
        u = rng.random()
        p = -1 if k == 0 or u < fresh else int(rng.integers(0, k)) if u < fresh + fork else k - 1
        if p < 0:
            context = base if k == 0 else rng.integers(1, 100, int(rng.integers(1, 4))).tolist()
        else:
            context = prompts[p] + responses[p] + rng.integers(200, 300, int(rng.integers(0, 3))).tolist()
        n = int(rng.integers(1, 4))
        parent.append(p)
        prompts.append(context)
        responses.append(list(range(token, token + n)))
        lps.append((-rng.random(n) - 0.01).tolist())
        token += n
    session = BranchingSession(parent, prompts, responses, lps, [None] * n_calls, {})
    if leaf_outcomes:
        session.outcome = [float(rng.integers(0, 5)) / 4 if leaf else None for leaf in session.is_leaf]
    calls = [dict(prompt_ids=pr, response_ids=r, response_logprobs=lp, parent=p,
                  **({"outcome": o} if o is not None else {}))
             for pr, r, lp, p, o in zip(prompts, responses, lps, parent, session.outcome)]
    session.records = encode_step_records(calls)
    return session


def branching_batch(sessions: list[BranchingSession], uids: list, rewards: list[float], P: int = 8, R: int = 8):
    """One row per session in verl's layout (its first call as the concatenated row, the session's reward on its last
    token; the rows come from the records), its records in ``traj_steps``: ``(tensors, non_tensors)``."""
    B = len(sessions)
    prompts, responses = torch.zeros(B, P, dtype=torch.long), torch.zeros(B, R, dtype=torch.long)
    mask, attn, rm, lps = (torch.zeros(B, R, dtype=torch.long), torch.zeros(B, P + R, dtype=torch.long),
                           torch.zeros(B, R), torch.zeros(B, R))
    for b, s in enumerate(sessions):
        p, r = s.prompt[0][-P:], s.response[0][:R]
        prompts[b, P - len(p):] = torch.tensor(p)
        responses[b, :len(r)] = torch.tensor(r)
        mask[b, :len(r)] = 1
        lps[b, :len(r)] = torch.tensor(s.log_probs[0][:R])
        attn[b, P - len(p):P + len(r)] = 1
        rm[b, len(r) - 1] = rewards[b]
    tensors = {"prompts": prompts, "responses": responses, "response_mask": mask, "rollout_log_probs": lps,
               "attention_mask": attn, "input_ids": torch.cat([prompts, responses], 1),
               "position_ids": torch.clip(attn.cumsum(-1) - 1, min=0), "rm_scores": rm}
    records = np.empty(B, dtype=object)
    records[:] = [s.records for s in sessions]
    non = {"uid": np.array(uids, dtype=object), "traj_steps": records,
           "traj_id": np.array([f"S{b}" for b in range(B)], dtype=object)}
    return tensors, non
