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

from verl_traj.stepwise.expand import expand_step_rows
from verl_traj.stepwise.records import encode_step_records
from verl_traj.testing.swebench import load_trajectories

__all__ = ["BranchingSession", "as_chain_records", "branching_batch", "branching_session", "layout_rows", "leaves_below",
           "swebench_session", "swebench_sessions"]


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


def swebench_session(rng: np.random.Generator, steps: list, prompt: list[int], first_token: int, vocab: int,
                     scale: int) -> BranchingSession:
    """A branching session with SWE-bench call lengths (``steps``: one trajectory's ``[prompt, response]`` tokens per
    step, divided by ``scale``): a trunk, then ``f`` in 2-4 branches per fork, forks nested 1-3 deep, each segment 1-3
    calls, 4 to 30 calls in all; every call's response and the observation before it take the next step's lengths
    (cycled). Calls in the order concurrent branches would issue them (:func:`_interleaved`); ``prompt``: the group's
    shared task."""
    f, depth = int(rng.integers(2, 5)), int(rng.integers(1, 4))
    lengths = [(max(1, r // scale), max(0, (p - q - s) // scale)) for (q, s), (p, r) in zip(steps, steps[1:])]
    lengths = lengths or [(max(1, steps[0][1] // scale), 0)]
    parent, prompts, responses, token, cursor = [], [], [], first_token, 0

    def call(p: int) -> int:
        nonlocal token, cursor
        resp_len, obs_len = lengths[cursor % len(lengths)]
        cursor += 1
        obs = rng.integers(1, vocab, obs_len if p >= 0 else 0).tolist()
        parent.append(p)
        prompts.append((prompts[p] + responses[p] if p >= 0 else list(prompt)) + obs)
        responses.append([(token + j) % (vocab - 1) + 1 for j in range(resp_len)])
        token += resp_len
        return len(parent) - 1

    def segment(p: int, level: int) -> None:
        for _ in range(int(rng.integers(1, 4))):
            if len(parent) >= 30:
                return
            p = call(p)
        if level < depth:
            for _ in range(f):
                segment(p, level + 1)

    segment(-1, 0)
    while len(parent) < 4:
        call(len(parent) - 1)
    parent, prompts, responses = _interleaved(rng, parent, prompts, responses)
    log_probs = [(-rng.random(len(r)) - 0.01).tolist() for r in responses]
    calls = [dict(prompt_ids=q, response_ids=r, response_logprobs=lp, parent=p)
             for q, r, lp, p in zip(prompts, responses, log_probs, parent)]
    return BranchingSession(parent, prompts, responses, log_probs, [None] * len(parent), encode_step_records(calls))


def _interleaved(rng: np.random.Generator, parent: list[int], prompts: list, responses: list):
    """The calls re-issued as concurrent branches finish: each next call a random one whose parent has been issued
    (a fork's branches interleave); parents renumbered."""
    kids: dict[int, list[int]] = {}
    for c, p in enumerate(parent):
        kids.setdefault(p, []).append(c)
    ready, order = list(kids.get(-1, [])), []
    while ready:
        c = ready.pop(int(rng.integers(0, len(ready))))
        order.append(c)
        ready += kids.get(c, [])
    new = {old: k for k, old in enumerate(order)}
    return ([new[parent[c]] if parent[c] >= 0 else -1 for c in order], [prompts[c] for c in order],
            [responses[c] for c in order])


def swebench_sessions(groups: int, n: int, seed: int, vocab: int, scale: int) -> tuple[list[BranchingSession], list]:
    """``groups`` GRPO groups of ``n`` :func:`swebench_session` each, a group's sessions on one SWE-bench trajectory's
    task and lengths (the shared data, :mod:`verl_traj.testing.swebench`); returns ``(sessions, uids)``."""
    trajs = load_trajectories()
    rng = np.random.default_rng(seed)
    sessions, uids, token = [], [], 1
    for g, t in enumerate(rng.choice(len(trajs), groups, replace=False).tolist()):
        steps = trajs[t]["steps"]
        prompt = rng.integers(1, vocab, max(1, steps[0][0] // scale)).tolist()
        for _ in range(n):
            sessions.append(swebench_session(rng, steps, prompt, token, vocab, scale))
            token += 7919
            uids.append(f"g{g}")
    return sessions, uids


def as_chain_records(session: BranchingSession) -> dict:
    """The session as verl_traj recorded it before calls named their parents: one chain in issue order, each call
    delta-encoded against the previous one (a call that does not extend it starts a row with its whole context)."""
    return encode_step_records([dict(prompt_ids=q, response_ids=r, response_logprobs=lp)
                                for q, r, lp in zip(session.prompt, session.response, session.log_probs)])


def layout_rows(layout: str, groups: int, n: int, seed: int, vocab: int, scale: int):
    """``(tensors, non_tensors)``: :func:`swebench_sessions` as step rows in ``layout`` (``tree``: the call tree's rows;
    ``paths``: one chain of rows per root-to-leaf path; ``chain``: recorded as one chain in issue order), prefix-merged,
    in verl's layout, with ``old_log_probs`` and a per-session ``advantages`` on the loss tokens (what an actor update
    reads)."""
    sessions, uids = swebench_sessions(groups, n, seed, vocab, scale)
    if layout == "chain":
        for s in sessions:
            s.records = as_chain_records(s)
    out = expand_step_rows(*branching_batch(sessions, uids, [1.0] * len(sessions)), merge_prefix=True,
                           branch_paths=layout == "paths")
    tensors = {k: v for k, v in out.tensors.items() if not k.startswith("traj_")}
    gen = torch.Generator().manual_seed(seed)
    mask = tensors["response_mask"]
    tensors["old_log_probs"] = -torch.rand(mask.shape, generator=gen) * 2 * mask
    tensors["advantages"] = (torch.randn(len(sessions), generator=gen)[out.source_row][:, None] * mask).contiguous()
    return tensors, out.non_tensors
