#!/usr/bin/env python
"""Training tokens of step-wise rows, prefix-merged rows and prefix trees on real multi-turn lengths (SWE-bench agent
trajectories).

Input: ../shared/data/swebench_steps.jsonl beside the repository (per-step [prompt_tokens, response_tokens], no text).
Token ids are synthesised per trajectory so that the MERGE FUNCTION and the TREE THEMSELVES decide every boundary:

* step i+1's prompt = step i's prompt + response + fresh observation tokens, when the recorded
  prompt grows by at least prompt_i + response_i (the conversation is append-only);
* otherwise (context rewritten / truncated) step i+1's prompt keeps the first min(P_0, P_{i+1})
  tokens (system prompt + task) and continues with fresh tokens, so it is not a continuation;
* ``--retokenise-prob p`` additionally re-tokenises the last ``--retokenise-tokens`` tokens of step i's response
  inside step i+1's prompt with probability p (a tokenizer that does not round-trip): no linear merge there, and the
  prefix tree branches there.

Every branch the construction makes really diverges (a re-tokenised token differs from the original; a GRPO group's
samples start their first responses with distinct tokens), so the number of distinct prefixes of a tree's rows is
known by construction and checked against ``tree_token_count``: tree tokens - branch copies == distinct prefixes.

Part 1 (``--retokenise-prob``): one row per call vs linear merge, rows / tokens / planned update time. Planned update
time: the slowest DP rank's workload summed over mini-batches (what a synchronous optimizer step waits for), from
``verl_traj.core.plan_mini_batches`` when it is importable, else from a workload model (verl's ``calculate_workload``
= 24576*L + L^2 per row, rows dealt greedily to the lightest rank); the output names which. Group ids:
``--group-size`` consecutive trajectories share a synthetic uid (GRPO group), or ``--group-by repo`` groups
consecutive trajectories of one repo.

Part 2 (issue 29): tokens forwarded per update, one row per call / linear merge / prefix tree
(``verl_traj.core.trees.prefix_tree.tree_token_count``), for

* the SWE data with ``--break-probs`` of the turn boundaries re-tokenised; one tree per trajectory (its step rows;
  the trajectories are different tasks and share no prompt);
* synthetic GRPO groups (``--grpo-sizes`` samples behind a ``--grpo-prompt-tokens`` shared prompt, ``--grpo-groups``
  groups per update, at ``--grpo-break-probs``): each sample's turns are a random data trajectory's (its response and
  observation lengths, its number of turns) after the shared prompt; one tree per group (all of its samples' rows).

Trajectories are processed one at a time (the step-wise layout alone is ~283M token ids).

    python scripts/bench_stepwise.py [--json] [--quick] [--dp 8] [--mini-batches 4] [--group-size 4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, fields
from typing import Any, Collection, Optional, Sequence

import numpy as np
import torch

from verl_traj.core.trees.prefix_tree import tree_token_count
from verl_traj.stepwise.prefix_merge import MergedRow, MergeStats, merge_trajectory_steps
from verl_traj.testing.swebench import DATA_FILE, load_trajectories

DEFAULT_DATA = str(DATA_FILE)
VOCAB = 150000
GOAL_BREAK_PROB = 0.1  # issue 29: tree >= 3.5x fewer tokens than linear merge with 10% of the boundaries re-tokenised
GOAL_RATIO = 3.5


@dataclass
class Synthesised:
    """One trajectory's synthetic step token ids.

    Attributes:
        prompts, responses: per step, 1-D int32 tensors.
        distinct_prefixes: distinct non-empty prefixes of the step rows ``prompt_i + response_i``, by construction
            (every synthesised token that does not repeat an earlier row's token at the same prefix adds one).
        breaks: boundaries where the next prompt does not extend the previous context token for token.
    """

    prompts: list[torch.Tensor]
    responses: list[torch.Tensor]
    distinct_prefixes: int
    breaks: int


def _rand(gen: torch.Generator, n: int, vocab: int) -> torch.Tensor:
    """``n`` uniform token ids in ``[0, vocab)`` (int32)."""
    return torch.randint(0, vocab, (int(n),), generator=gen, dtype=torch.int32)


def step_rows(s: Synthesised) -> list[torch.Tensor]:
    """One row per call: ``prompt_i + response_i``."""
    return [torch.cat([p, r]) for p, r in zip(s.prompts, s.responses)]


def _children(rows: Sequence[torch.Tensor], prefix: torch.Tensor) -> set[int]:
    """The tokens that follow ``prefix`` in ``rows`` (the existing children of that trie node)."""
    k = prefix.numel()
    return {int(r[k]) for r in rows if r.numel() > k and torch.equal(r[:k], prefix)}


def _new_child(token: int, taken: Collection[int], vocab: int) -> int:
    """``token``, moved to the next free id when it is already a child of the node (so the branch diverges)."""
    if len(set(taken)) >= vocab:
        raise ValueError(f"every one of the {vocab} token ids already follows this prefix: no branch can diverge")
    while token in taken:
        token = (token + 1) % vocab
    return token


def _diverge(after: torch.Tensor, node: torch.Tensor, rows: Sequence[torch.Tensor], taken: Collection[int],
             vocab: int) -> None:
    """Make ``node + after`` leave the trie of ``rows`` right after ``node``: ``after[0]`` (in place) becomes an id
    that no row (and none of ``taken``) puts after ``node``. Only for nodes that may already have children."""
    if after.numel():
        after[0] = _new_child(int(after[0]), _children(rows, node) | set(taken), vocab)


def synthesise_steps(steps: Sequence[Sequence[int]], gen: torch.Generator, retokenise_prob: float, *,
                     vocab: int = VOCAB, retokenise_tokens: int = 1, head: Optional[torch.Tensor] = None,
                     first_token: Optional[int] = None, head_children: Collection[int] = (),
                     others: Sequence[Synthesised] = ()) -> Synthesised:
    """Token ids for one trajectory's steps ``[[prompt_tokens, response_tokens], ...]`` (see the module docstring).

    Every token that starts a branch off an existing trie node (a re-tokenised tail, a rewritten context, a GRPO
    sample's first token, a row continuing a row that added nothing new) differs from that node's existing children,
    so each step adds exactly its new tokens to ``distinct_prefixes``.

    Args:
        gen: the random stream (the draws do not depend on ``retokenise_tokens``, so linear merge's rows do not either).
        retokenise_tokens: how many of a re-tokenised response's last tokens the next prompt sees changed.
        head: step 0's prompt (a GRPO group's shared prompt; ``steps[0][0]`` must be its length), else random.
        first_token: step 0's first response token (distinct per sample of a group, so their rows branch there).
        head_children: the tokens the group's samples put right after ``head`` (their first tokens).
        others: the group's samples synthesised before this one (their rows share ``head``'s prefixes).
    """
    prompts: list[torch.Tensor] = []
    responses: list[torch.Tensor] = []
    p0 = int(steps[0][0])
    distinct = breaks = 0
    leaf = False  # the previous row added a token: its end is a new trie node that no other row continues

    def rows() -> list[torch.Tensor]:  # every row so far that may share a node with the next one
        return [torch.cat(x) for x in zip(prompts, responses)] + [r for o in others for r in step_rows(o)]

    def taken_at(node: torch.Tensor) -> Collection[int]:  # the head's children of the samples not synthesised yet
        at_head = head is not None and node.numel() == head.numel() and torch.equal(node, head)
        return head_children if at_head else ()

    for i, (p, r) in enumerate(steps):
        p, r = int(p), int(r)
        if i == 0:
            if head is not None and head.numel() != p:
                raise ValueError(f"steps[0][0] = {p} is not the shared prompt's length {head.numel()}")
            prompt = head if head is not None else _rand(gen, p, vocab)
            response = _rand(gen, r, vocab)
            if first_token is not None:
                if not r:
                    raise ValueError("first_token needs a non-empty first response")
                response[0] = first_token
            new = p
        else:
            prev_full = prompts[-1].numel() + responses[-1].numel()
            if p >= prev_full:
                seen, obs, new = responses[-1], _rand(gen, p - prev_full, vocab), p - prev_full
                if retokenise_prob > 0 and seen.numel() and float(torch.rand(1, generator=gen)) < retokenise_prob:
                    k = min(retokenise_tokens, seen.numel())  # the last k response tokens come back as other tokens
                    tail = (seen[-k:] + 1) % vocab
                    if k == seen.numel():  # the branch starts at the previous prompt's end, maybe an existing node
                        _diverge(tail, prompts[-1], rows(), taken_at(prompts[-1]), vocab)
                    seen = torch.cat([seen[:-k], tail])
                    new, breaks = new + k, breaks + 1
                response = _rand(gen, r, vocab)
                if not leaf:  # the previous row ended on an existing node (it added nothing): a branch starts here
                    node = torch.cat([prompts[-1], seen])
                    _diverge(obs if obs.numel() else response, node, rows(), taken_at(node), vocab)
                prompt = torch.cat([prompts[-1], seen, obs])
            else:
                keep = min(p0, p)
                obs, response = _rand(gen, p - keep, vocab), _rand(gen, r, vocab)
                node = prompts[0][:keep]
                _diverge(obs if obs.numel() else response, node, rows(), taken_at(node), vocab)
                prompt, new, breaks = torch.cat([node, obs]), p - keep, breaks + 1
        prompts.append(prompt)
        responses.append(response)
        distinct += new + r
        leaf = new + r > 0  # (a row that added nothing is treated as ending on a shared node: always safe)
    return Synthesised(prompts, responses, distinct, breaks)


def synthesise_trajectory(steps: list[list[int]], gen: torch.Generator, retokenise_prob: float, vocab: int = VOCAB,
                          retokenise_tokens: int = 1) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Token ids for one trajectory's steps (lists of 1-D int32 tensors); see :func:`synthesise_steps`."""
    s = synthesise_steps(steps, gen, retokenise_prob, vocab=vocab, retokenise_tokens=retokenise_tokens)
    return s.prompts, s.responses


def load(path: str) -> list[dict[str, Any]]:
    return load_trajectories(path)


def group_ids(trajs: list[dict[str, Any]], group_by: str, group_size: int) -> list[str]:
    if group_by == "repo":
        out, prev, g = [], None, -1
        for t in trajs:
            repo = str(t["id"]).split("__")[0]
            if repo != prev:
                g, prev = g + 1, repo
            out.append(f"repo{g}:{repo}")
        return out
    return [f"g{k // group_size}" for k in range(len(trajs))]


def plan_time(rows_tokens, rows_loss, rows_uid, rows_traj, rows_step, rows_last, dp: int, mini_batches: int, seed: int,
              planner: str = "auto"):
    """Slowest-rank workload summed over mini-batches; returns (value, method, extra)."""
    try:
        if planner == "model":
            raise ImportError("--planner model")
        from verl_traj.core.plan.layout import build_layout_from_counts
        from verl_traj.core.plan.planning import plan_mini_batches
    except Exception as exc:  # planner not landed yet (or forced off)
        method = (f"workload model (verl calculate_workload, groups LPT over mini-batches, rows greedy over {dp} ranks; "
                  f"core planner not used: {exc})")
        return _model_time(rows_tokens, rows_uid, dp, mini_batches), method, {}
    layout = build_layout_from_counts(
        np.asarray(rows_tokens, dtype=np.int64),
        np.asarray(rows_loss, dtype=np.int64),
        np.asarray(rows_uid, dtype=object),
        np.asarray(rows_traj, dtype=object),
        np.asarray(rows_step, dtype=np.int64),
        np.asarray(rows_last, dtype=bool),
    )
    t0 = time.perf_counter()
    plan = plan_mini_batches(layout, mini_batches, dp, group_by="group", balance_dp=True, workload="verl", seed=seed)
    dt = time.perf_counter() - t0
    s = plan.stats
    extra = {
        "plan_seconds": dt,
        "padding_rows": int(s.padding_rows.sum()),
        "balance_ratio_worst": float((s.max_rank_workload.double() / s.workload_lower_bound.double().clamp(min=1)).max()),
        "optimizer_steps": int(plan.num_mini_batches),
    }
    return int(s.max_rank_workload.sum()), f"verl_traj.core.plan_mini_batches (dp={dp}, workload=verl, group_by=group)", extra


def _model_time(tokens, uid, dp, mini_batches):
    tokens = np.asarray(tokens, dtype=np.int64)
    w = 24576 * tokens + tokens * tokens
    _, g = np.unique(np.asarray(uid, dtype=object).astype(str), return_inverse=True)
    G = int(g.max()) + 1
    gw = np.bincount(g, weights=w, minlength=G)
    mb_of_g = np.zeros(G, dtype=np.int64)
    load = np.zeros(mini_batches)
    for k in np.argsort(-gw, kind="stable"):
        m = int(np.argmin(load))
        mb_of_g[k] = m
        load[m] += gw[k]
    total = 0
    mb = mb_of_g[g]
    for m in range(mini_batches):
        ranks = np.zeros(dp, dtype=np.int64)
        for i in np.argsort(-w[mb == m], kind="stable"):
            ranks[int(np.argmin(ranks))] += int(w[mb == m][i])
        total += int(ranks.max())
    return total


def expand_timing(trajs: list[dict[str, Any]], uids: list[str], seed: int) -> dict[str, Any]:
    """Driver-side cost of ``expand_step_rows`` on one rollout batch of these trajectories: the
    concatenated rows (verl's layout) + delta-encoded per-call records, as the step-wise agent loop
    produces them; merged and step-wise."""
    from verl_traj.stepwise.expand import encode_step_records, expand_step_rows

    gen = torch.Generator().manual_seed(seed)
    recs, rows = [], []
    for t in trajs:
        p, r = synthesise_trajectory(t["steps"], gen, 0.0)
        recs.append(encode_step_records([{"prompt_ids": a.numpy(), "response_ids": b.numpy()} for a, b in zip(p, r)]))
        p0 = p[0].numel()
        full = torch.cat([p[-1], r[-1]]).long()
        mask = torch.zeros(full.numel() - p0, dtype=torch.long)
        for a, b in zip(p, r):
            mask[a.numel() - p0 : a.numel() - p0 + b.numel()] = 1
        rows.append((p[0].long(), full[p0:], mask))
        del p, r
    B = len(rows)
    P = max(x[0].numel() for x in rows)
    R = max(x[1].numel() for x in rows)
    tensors = {
        "prompts": torch.zeros(B, P, dtype=torch.long),
        "responses": torch.zeros(B, R, dtype=torch.long),
        "response_mask": torch.zeros(B, R, dtype=torch.long),
        "attention_mask": torch.zeros(B, P + R, dtype=torch.long),
        "rm_scores": torch.zeros(B, R),
    }
    for b, (p, r, m) in enumerate(rows):
        tensors["prompts"][b, P - p.numel():] = p
        tensors["responses"][b, : r.numel()] = r
        tensors["response_mask"][b, : r.numel()] = m
        tensors["attention_mask"][b, P - p.numel(): P + r.numel()] = 1
        tensors["rm_scores"][b, r.numel() - 1] = 1.0
    col = np.empty(B, dtype=object)
    col[:] = recs
    non = {"uid": np.asarray(uids[:B], dtype=object), "traj_steps": col}
    out: dict[str, Any] = {"trajectories": B}
    for merge in (True, False):
        t0 = time.perf_counter()
        res = expand_step_rows(tensors, non, merge_prefix=merge)
        dt = time.perf_counter() - t0
        key = "merged" if merge else "stepwise"
        out[f"{key}_seconds"] = round(dt, 3)
        out[f"{key}_shape"] = list(res.tensors["input_ids"].shape)
        out[f"{key}_padded_bytes"] = int(sum(v.numel() * v.element_size() for v in res.tensors.values()))
        del res
    return out


@dataclass
class TokenCounts:
    """What one update forwards under each layout (sums over trajectories / trees with ``+``)."""

    trajectories: int = 0
    boundaries: int = 0  # turn boundaries (step i -> i+1)
    broken_boundaries: int = 0  # of which not a token-for-token continuation
    rows_per_call: int = 0
    tokens_per_call: int = 0
    rows_linear: int = 0
    tokens_linear: int = 0
    trees: int = 0
    tokens_tree: int = 0
    branch_copies: int = 0
    distinct_prefixes: int = 0

    def __add__(self, other: "TokenCounts") -> "TokenCounts":
        return TokenCounts(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


@dataclass
class SwePass:
    """One pass over the SWE trajectories at one break probability: the token counts, linear merge's statistics and
    the per-row columns the planner takes (``tokens, loss, uid, traj, step, last``) for both layouts."""

    counts: TokenCounts
    merge: MergeStats
    call_columns: dict[str, list]
    merged_columns: dict[str, list]
    max_len_step: int
    max_len_merged: int
    seconds_synthesise: float
    seconds_merge: float
    seconds_tree: float


def parse_list(text: str, kind: type) -> list:
    """``"0,0.1,0.3"`` -> ``[0.0, 0.1, 0.3]`` (``kind`` = ``float`` or ``int``)."""
    return [kind(x) for x in text.split(",") if x.strip()]


def derived_seed(*parts: int) -> int:
    """A deterministic 63-bit seed from integers (one random stream per scenario)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, dtype=np.uint64)[0] >> 1)


def tree_rows_of(s: Synthesised, rows: Sequence[MergedRow], tree_rows: str) -> list[torch.Tensor]:
    """The rows a trajectory puts into its tree: every step row (``"steps"``) or linear merge's rows (``"merged"``).

    Both give the same tree: a merged row is its last step's row, and every step row is a prefix of its merged row,
    so the two sets have the same prefixes and the same branches; ``"merged"`` skips the O(T^2) step tokens."""
    if tree_rows == "steps":
        return step_rows(s)
    return [torch.cat([row.prompt_ids, row.response_ids]) for row in rows]


def tree_counts(rows: Sequence[torch.Tensor], distinct_prefixes: int, where: str) -> tuple[int, int]:
    """``(tree tokens, branch copies)`` of one tree, checked against the distinct prefixes known by construction."""
    tokens, copies = tree_token_count(rows)
    if tokens - copies != distinct_prefixes:
        raise AssertionError(f"{where}: tree tokens {tokens} - branch copies {copies} != distinct prefixes "
                             f"{distinct_prefixes}")
    return tokens, copies


def trajectory_counts(s: Synthesised, rows: Sequence[MergedRow], st: MergeStats) -> TokenCounts:
    """One trajectory's per-call and linear-merge counts (the tree fields are filled per tree)."""
    n = len(s.prompts)
    return TokenCounts(trajectories=1, boundaries=max(n - 1, 0), broken_boundaries=s.breaks, rows_per_call=n,
                       tokens_per_call=st.tokens_before, rows_linear=len(rows), tokens_linear=st.tokens_after)


def swe_pass(trajs: Sequence[dict[str, Any]], uids: Sequence[str], retokenise_prob: float, seed: int,
             retokenise_tokens: int, tree_rows: str) -> SwePass:
    """Synthesise, merge and count every SWE trajectory (one tree per trajectory) at one break probability."""
    gen = torch.Generator().manual_seed(seed)
    counts, total = TokenCounts(), MergeStats()
    cols = ("tokens", "loss", "uid", "traj", "step", "last")
    call_columns: dict[str, list] = {k: [] for k in cols}
    merged_columns: dict[str, list] = {k: [] for k in cols}
    max_len_step = max_len_merged = 0
    t_synth = t_merge = t_tree = 0.0
    for k, (t, uid) in enumerate(zip(trajs, uids)):
        steps = t["steps"]
        if not steps:
            continue
        t0 = time.perf_counter()
        s = synthesise_steps(steps, gen, retokenise_prob, retokenise_tokens=retokenise_tokens)
        t1 = time.perf_counter()
        rows, st = merge_trajectory_steps(s.prompts, s.responses)
        t2 = time.perf_counter()
        n_tree, copies = tree_counts(tree_rows_of(s, rows, tree_rows), s.distinct_prefixes, f"trajectory {k}")
        t3 = time.perf_counter()
        t_synth, t_merge, t_tree = t_synth + t1 - t0, t_merge + t2 - t1, t_tree + t3 - t2
        total = total + st
        counts = counts + trajectory_counts(s, rows, st) + TokenCounts(
            trees=1, tokens_tree=n_tree, branch_copies=copies, distinct_prefixes=s.distinct_prefixes)
        n = len(steps)
        call_columns["tokens"] += [p.numel() + r.numel() for p, r in zip(s.prompts, s.responses)]
        call_columns["loss"] += [r.numel() for r in s.responses]
        call_columns["uid"] += [uid] * n
        call_columns["traj"] += [k] * n
        call_columns["step"] += list(range(n))
        call_columns["last"] += [False] * (n - 1) + [True]
        for row in rows:
            merged_columns["tokens"].append(row.num_tokens)
            merged_columns["loss"].append(int(torch.count_nonzero(row.response_mask)))
            merged_columns["uid"].append(uid)
            merged_columns["traj"].append(k)
            merged_columns["step"].append(row.step_index)
            merged_columns["last"].append(row.is_last_step)
        max_len_step = max(max_len_step, max(call_columns["tokens"][-n:]))
        max_len_merged = max(max_len_merged, max(r.num_tokens for r in rows))
        del s, rows
    assert total.loss_tokens_before == total.loss_tokens_after, "loss tokens changed by merging"
    assert sum(call_columns["loss"]) == sum(merged_columns["loss"]) == total.loss_tokens_after
    return SwePass(counts, total, call_columns, merged_columns, max_len_step, max_len_merged, t_synth, t_merge, t_tree)


def grpo_steps(steps: Sequence[Sequence[int]], prompt_tokens: int) -> list[list[int]]:
    """A data trajectory's turns behind a shared prompt of ``prompt_tokens`` (its own first prompt replaced: every
    later prompt keeps its growth, i.e. the same responses and observations)."""
    p0 = int(steps[0][0])
    return [[int(p) - p0 + prompt_tokens, int(r)] for p, r in steps]


def synthesise_group(samples: Sequence[Sequence[Sequence[int]]], head: torch.Tensor, firsts: Sequence[int],
                     gen: torch.Generator, retokenise_prob: float, retokenise_tokens: int,
                     vocab: int = VOCAB) -> tuple[list[Synthesised], int]:
    """One GRPO group: sample ``j`` takes the turns ``samples[j]`` (already behind the shared prompt ``head``) and
    starts its first response with ``firsts[j]`` (distinct ids). Returns the samples and the group's distinct
    prefixes (the shared prompt's counted once)."""
    out: list[Synthesised] = []
    for steps, first in zip(samples, firsts):
        out.append(synthesise_steps(steps, gen, retokenise_prob, vocab=vocab, retokenise_tokens=retokenise_tokens,
                                    head=head, first_token=first, head_children=firsts, others=out))
    return out, head.numel() + sum(s.distinct_prefixes - head.numel() for s in out)


def grpo_pass(pool: Sequence[Sequence[Sequence[int]]], group_size: int, prompt_tokens: int, groups: int,
              retokenise_prob: float, seed: int, retokenise_tokens: int, tree_rows: str,
              vocab: int = VOCAB) -> TokenCounts:
    """``groups`` GRPO groups of ``group_size`` samples behind a shared random prompt; one tree per group.

    Each sample's turns are those of a random trajectory of ``pool`` (:func:`grpo_steps`); its first response starts
    with a token distinct from its siblings'. Which trajectories' turns the samples take depends on ``(seed,
    group_size)`` only, so prompt lengths and break probabilities are compared on the same samples."""
    pick_gen = torch.Generator().manual_seed(derived_seed(seed, group_size))
    head_gen = torch.Generator().manual_seed(derived_seed(seed, group_size, prompt_tokens))
    gen = torch.Generator().manual_seed(derived_seed(seed, group_size, round(retokenise_prob * 1e6)))
    counts = TokenCounts()
    for g in range(groups):
        head = _rand(head_gen, prompt_tokens, vocab)
        firsts = torch.randperm(vocab, generator=pick_gen)[:group_size].tolist()
        picks = torch.randint(0, len(pool), (group_size,), generator=pick_gen).tolist()
        samples, distinct = synthesise_group([grpo_steps(pool[k], prompt_tokens) for k in picks], head, firsts, gen,
                                             retokenise_prob, retokenise_tokens, vocab)
        group_rows: list[torch.Tensor] = []
        for s in samples:
            rows, st = merge_trajectory_steps(s.prompts, s.responses)
            counts = counts + trajectory_counts(s, rows, st)
            group_rows += tree_rows_of(s, rows, tree_rows)
        n_tree, copies = tree_counts(group_rows, distinct, f"GRPO group {g} (n={group_size}, prompt {prompt_tokens})")
        counts = counts + TokenCounts(trees=1, tokens_tree=n_tree, branch_copies=copies, distinct_prefixes=distinct)
    return counts


def scenario(name: str, counts: TokenCounts, seconds: float, **params: Any) -> dict[str, Any]:
    """One row of the tree table (JSON): the counts, the checks and the ratios."""
    out: dict[str, Any] = {"scenario": name, **params, **{f.name: getattr(counts, f.name) for f in fields(counts)}}
    out["tree_equals_distinct_prefixes"] = counts.tokens_tree - counts.branch_copies == counts.distinct_prefixes
    out["broken_fraction"] = counts.broken_boundaries / max(counts.boundaries, 1)
    out["linear_over_tree"] = counts.tokens_linear / max(counts.tokens_tree, 1)
    out["per_call_over_tree"] = counts.tokens_per_call / max(counts.tokens_tree, 1)
    out["per_call_over_linear"] = counts.tokens_per_call / max(counts.tokens_linear, 1)
    out["seconds"] = round(seconds, 2)
    return out


def swe_scenario(p: SwePass, retokenise_prob: float) -> dict[str, Any]:
    """The tree-table row of one SWE pass."""
    seconds = p.seconds_synthesise + p.seconds_merge + p.seconds_tree
    return scenario(f"SWE, {retokenise_prob:.0%} breaks", p.counts, seconds, kind="swe",
                    retokenise_prob=retokenise_prob, tree_per="trajectory")


def grpo_scenario(pool: Sequence[Sequence[Sequence[int]]], group_size: int, prompt_tokens: int, groups: int,
                  retokenise_prob: float, seed: int, retokenise_tokens: int, tree_rows: str) -> dict[str, Any]:
    """The tree-table row of one GRPO configuration."""
    t0 = time.perf_counter()
    counts = grpo_pass(pool, group_size, prompt_tokens, groups, retokenise_prob, seed, retokenise_tokens, tree_rows)
    return scenario(f"GRPO n={group_size}, {prompt_tokens / 1024:g}K prompt, {retokenise_prob:.0%} breaks",
                    counts, time.perf_counter() - t0, kind="grpo", retokenise_prob=retokenise_prob,
                    group_size=group_size, shared_prompt_tokens=prompt_tokens, groups=groups, tree_per="group")


def goal_check(scenarios: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Issue 29's target: tree tokens = distinct prefixes + copies everywhere, and on the SWE data with 10% of the
    boundaries re-tokenised the tree forwards >= 3.5x fewer tokens than linear merge."""
    out: dict[str, Any] = {"target_ratio": GOAL_RATIO, "break_prob": GOAL_BREAK_PROB,
                           "all_trees_at_distinct_prefix_limit": all(s["tree_equals_distinct_prefixes"]
                                                                     for s in scenarios)}
    at = [s for s in scenarios if s["kind"] == "swe" and abs(s["retokenise_prob"] - GOAL_BREAK_PROB) < 1e-12]
    out["linear_over_tree"] = at[0]["linear_over_tree"] if at else None
    out["met"] = bool(at) and out["all_trees_at_distinct_prefix_limit"] and at[0]["linear_over_tree"] >= GOAL_RATIO
    return out


def tree_table(scenarios: Sequence[dict[str, Any]]) -> list[str]:
    """The tree comparison as text lines."""
    head = (f"{'scenario':<34} {'breaks':>7} {'one row per call':>17} {'linear merge':>13} {'tree':>12} "
            f"{'copies':>7} {'distinct prefixes':>18} {'=':>2} {'linear/tree':>11} {'per call/tree':>13}")
    lines = [head, "-" * len(head)]
    for s in scenarios:
        lines.append(f"{s['scenario']:<34} {s['broken_fraction']:>7.1%} {s['tokens_per_call']:>17,} "
                     f"{s['tokens_linear']:>13,} {s['tokens_tree']:>12,} {s['branch_copies']:>7,} "
                     f"{s['distinct_prefixes']:>18,} {'ok' if s['tree_equals_distinct_prefixes'] else 'NO':>2} "
                     f"{s['linear_over_tree']:>10.2f}x {s['per_call_over_tree']:>12.2f}x")
    return lines


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line (``--quick``: the first 16 trajectories and one GRPO group per configuration, for tests)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--limit", type=int, default=None, help="first N trajectories only")
    ap.add_argument("--quick", action="store_true", help="--limit 16 (unless given) and --grpo-groups 1")
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--mini-batches", type=int, default=4)
    ap.add_argument("--group-by", choices=["synthetic", "repo"], default="synthetic")
    ap.add_argument("--group-size", type=int, default=4, help="trajectories per synthetic GRPO group")
    ap.add_argument("--retokenise-prob", type=float, default=0.0,
                    help="break probability of the step-wise vs merged table (part 1)")
    ap.add_argument("--retokenise-tokens", type=int, default=3,
                    help="a re-tokenised boundary changes this many of the previous response's last tokens")
    ap.add_argument("--break-probs", default="0,0.1,0.3", help="SWE break probabilities of the tree table")
    ap.add_argument("--grpo-sizes", default="8,16", help="GRPO samples per group (tree table)")
    ap.add_argument("--grpo-prompt-tokens", default="2048,8192", help="shared prompt lengths (tree table)")
    ap.add_argument("--grpo-break-probs", default="0,0.1", help="GRPO break probabilities (tree table)")
    ap.add_argument("--grpo-groups", type=int, default=8, help="GRPO groups per update")
    ap.add_argument("--tree-rows", choices=["merged", "steps"], default="merged",
                    help="rows given to tree_token_count: linear merge's rows (fast) or every step row (same tree)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--planner", choices=["auto", "model"], default="auto",
                    help="auto: verl_traj.core.plan_mini_batches if importable, else the workload model")
    ap.add_argument("--expand-trajectories", type=int, default=0,
                    help="also time expand_step_rows on one rollout batch of the first N trajectories")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args(argv)
    if args.quick:
        args.limit = 16 if args.limit is None else args.limit
        args.grpo_groups = 1
    return args


def merge_summary(p: SwePass, args: argparse.Namespace, trajectories: int) -> dict[str, Any]:
    """Part 1: step-wise vs linear merge at ``--retokenise-prob`` (rows, tokens, planned update workload)."""
    cols = ("tokens", "loss", "uid", "traj", "step", "last")
    res_step = plan_time(*(p.call_columns[k] for k in cols), args.dp, args.mini_batches, args.seed, args.planner)
    res_merged = plan_time(*(p.merged_columns[k] for k in cols), args.dp, args.mini_batches, args.seed, args.planner)
    total = p.merge
    groups = (f" (uid = {args.group_size} consecutive trajectories)" if args.group_by == "synthetic"
              else " (consecutive trajectories of one repo)")
    return {
        "data": os.path.basename(args.data),
        "trajectories": trajectories,
        "groups": f"{args.group_by}{groups}",
        "retokenise_prob": args.retokenise_prob,
        "rows_stepwise": total.rows_before,
        "rows_merged": total.rows_after,
        "tokens_stepwise": total.tokens_before,
        "tokens_merged": total.tokens_after,
        "token_ratio": total.token_ratio,
        "loss_tokens_stepwise": total.loss_tokens_before,
        "loss_tokens_merged": total.loss_tokens_after,
        "loss_tokens_identical": total.loss_tokens_before == total.loss_tokens_after,
        "max_row_tokens_stepwise": p.max_len_step,
        "max_row_tokens_merged": p.max_len_merged,
        "planned_update_workload_stepwise": res_step[0],
        "planned_update_workload_merged": res_merged[0],
        "planned_update_speedup": res_step[0] / max(res_merged[0], 1),
        "planner": res_step[1],
        "dp": args.dp,
        "mini_batches": args.mini_batches,
        "plan_extra_stepwise": res_step[2],
        "plan_extra_merged": res_merged[2],
        "seconds_synthesise": round(p.seconds_synthesise, 2),
        "seconds_merge": round(p.seconds_merge, 2),
        "merge_tokens_per_second": total.tokens_before / max(p.seconds_merge, 1e-9),
    }


def print_merge_table(out: dict[str, Any], args: argparse.Namespace) -> None:
    """Part 1 as a table."""
    print(f"data: {out['data']}  trajectories: {out['trajectories']}  groups: {out['groups']}  "
          f"retokenise_prob: {args.retokenise_prob}")
    print(f"planner: {out['planner']}  mini-batches: {args.mini_batches}")
    print()
    w = 30
    print(f"{'':{w}} {'step-wise':>16} {'merged':>16} {'ratio':>8}")

    def line(name: str, a: int, b: int) -> None:
        print(f"{name:{w}} {a:>16,} {b:>16,} {a / max(b, 1):>8.2f}x")

    line("rows", out["rows_stepwise"], out["rows_merged"])
    line("training tokens", out["tokens_stepwise"], out["tokens_merged"])
    line("loss tokens", out["loss_tokens_stepwise"], out["loss_tokens_merged"])
    line("longest row (tokens)", out["max_row_tokens_stepwise"], out["max_row_tokens_merged"])
    line("planned update workload", out["planned_update_workload_stepwise"], out["planned_update_workload_merged"])
    print()
    print(f"loss tokens identical: {out['loss_tokens_identical']}; merge time {out['seconds_merge']:.1f}s "
          f"({out['merge_tokens_per_second'] / 1e6:.0f}M step tokens/s), synthesis {out['seconds_synthesise']:.1f}s")
    if "expand_step_rows" in out:
        e = out["expand_step_rows"]
        print(f"expand_step_rows on one batch of {e['trajectories']} trajectories: merged {e['merged_seconds']:.2f}s "
              f"-> {e['merged_shape']} ({e['merged_padded_bytes'] / 2**30:.2f} GiB padded tensors); step-wise "
              f"{e['stepwise_seconds']:.2f}s -> {e['stepwise_shape']} ({e['stepwise_padded_bytes'] / 2**30:.2f} GiB)")
    print("planned update workload = sum over mini-batches of the slowest rank's sum of 24576*L + L^2 (verl's "
          "calculate_workload; relative units, lower is faster)")


def print_tree_table(tree: dict[str, Any]) -> None:
    """Part 2 as a table, with the goal line."""
    print()
    print(f"tokens forwarded per update: one row per call / linear prefix merge / prefix tree "
          f"(tree rows: {tree['tree_rows']}; a break re-tokenises {tree['retokenise_tokens']} tokens)")
    groups = tree["grpo_groups"]
    print(f"SWE: {tree['swe_trajectories']} trajectories = one update, one tree per trajectory; GRPO: {groups} "
          f"group{'s' if groups != 1 else ''} = one update, one tree per group, each sample's turns a data trajectory's")
    for line in tree_table(tree["scenarios"]):
        print(line)
    g = tree["goal"]
    ratio = "n/a" if g["linear_over_tree"] is None else f"{g['linear_over_tree']:.2f}x"
    print(f"'=': tree tokens - branch copies == distinct prefixes (asserted per tree): "
          f"{g['all_trees_at_distinct_prefix_limit']}")
    print(f"goal (issue 29): tree >= {g['target_ratio']}x below linear merge at {g['break_prob']:.0%} breaks "
          f"(SWE, {tree['swe_trajectories']} trajectories): {ratio} -> {'met' if g['met'] else 'NOT met'}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    trajs = load(args.data)[: args.limit]
    uids = group_ids(trajs, args.group_by, args.group_size)
    break_probs = parse_list(args.break_probs, float)
    passes = {prob: swe_pass(trajs, uids, prob, args.seed, args.retokenise_tokens, args.tree_rows)
              for prob in dict.fromkeys([*break_probs, args.retokenise_prob])}
    out = merge_summary(passes[args.retokenise_prob], args, len(trajs))
    if args.expand_trajectories:
        out["expand_step_rows"] = expand_timing(trajs[: args.expand_trajectories], uids, args.seed)

    pool = [t["steps"] for t in trajs if t["steps"]]
    scenarios = [swe_scenario(passes[prob], prob) for prob in break_probs]
    for prob in parse_list(args.grpo_break_probs, float):
        for n in parse_list(args.grpo_sizes, int):
            for prompt_tokens in parse_list(args.grpo_prompt_tokens, int):
                scenarios.append(grpo_scenario(pool, n, prompt_tokens, args.grpo_groups, prob, args.seed,
                                               args.retokenise_tokens, args.tree_rows))
    out["prefix_tree"] = {
        "tree_rows": args.tree_rows,
        "retokenise_tokens": args.retokenise_tokens,
        "swe_trajectories": len(trajs),
        "grpo_groups": args.grpo_groups,
        "scenarios": scenarios,
        "goal": goal_check(scenarios),
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print_merge_table(out, args)
    print_tree_table(out["prefix_tree"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
