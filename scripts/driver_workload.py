"""The driver benchmark's workload: a v0 step-wise rollout batch of ``prompts x n`` agent trajectories whose per-call
lengths come from real SWE-bench agent runs (``shared/data/swebench_steps.jsonl``), built as verl's agent loop and
verl_traj's step-recording mixin leave it for ``_balance_batch``.

Each prompt (GRPO group) takes the first prompt of one recorded trajectory; each of its ``n`` samples replays the
calls of a recorded trajectory drawn at random (response and observation lengths per call). Lengths are multiplied
by ``token_scale`` (>= 1 token). Then, as verl would: the first prompt is left-truncated to ``prompt_len``
(``data.truncation=left``); a trajectory stops at ``max_turns`` calls or where its context reaches its row budget
(prompt + ``response_len``: ``StepRecordingMixin.run`` -> ``truncate_calls`` drops a call whose prompt alone reaches
it and cuts a response at it). Token ids are random (observations from a large vocabulary: GiGPO step groups are
then the groups' first calls, which share the prompt).

The batch: one row per trajectory (prompt left-padded to ``prompt_len``, the concatenated multi-turn response
right-padded to ``response_len``, ``response_mask`` 0 on observations, ``rollout_log_probs``, ``rm_scores`` with a 0/1
outcome on the last token), ``uid`` per prompt, ``traj_id`` per trajectory, and each row's LLM calls delta-encoded
in ``traj_steps`` (the form :func:`verl_traj.stepwise.expand.encode_step_records` gives: the agent loop's output).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from verl_traj.stepwise.anchors import observation_anchor
from verl_traj.stepwise.expand import DEFAULT_STEPS_KEY
from verl_traj.testing.swebench import load_trajectories

__all__ = ["Workload", "Trajectories", "draw", "rollout_batch"]


@dataclass(frozen=True)
class Workload:
    """The sizes: ``prompts`` GRPO groups of ``n`` trajectories of at most ``max_turns`` LLM calls, rows capped at
    ``prompt_len + response_len`` tokens, recorded lengths scaled by ``token_scale``."""

    prompts: int
    n: int
    max_turns: int
    prompt_len: int
    response_len: int
    token_scale: float
    seed: int = 0

    def describe(self) -> str:
        return (f"{self.prompts} prompts x {self.n} samples, <= {self.max_turns} calls a trajectory; SWE-bench "
                f"per-call lengths x {self.token_scale:g}; rows capped at {self.prompt_len} + {self.response_len} "
                "tokens (prompt left-truncated; a trajectory stops at the turn limit or where its context reaches "
                "prompt + response_len, as truncate_calls does)")


@dataclass(frozen=True)
class Trajectories:
    """Per-call lengths of the ``B = prompts x n`` trajectories: ``prompt [B]`` (first prompt), flat per call
    ``obs`` (tokens the call saw since the previous call's response; the prompt for call 0) and ``resp``, ``calls [B]``
    (>= 1) with ``start [B]`` the first call's flat index. Invariant: each row fits ``prompt + response_len``."""

    prompt: np.ndarray
    obs: np.ndarray
    resp: np.ndarray
    calls: np.ndarray
    start: np.ndarray
    group: np.ndarray  # [B] prompt index

    @property
    def row_tokens(self) -> np.ndarray:
        """``[B]`` tokens of each concatenated row: prompt, then every response and observation."""
        total = np.add.reduceat(self.obs + self.resp, self.start)
        return total


def _scaled(x: np.ndarray, scale: float) -> np.ndarray:
    return np.maximum(1, np.rint(x * scale)).astype(np.int64)


def _truncated(prompt: int, obs: np.ndarray, resp: np.ndarray, w: Workload) -> tuple[np.ndarray, np.ndarray]:
    """One trajectory's calls cut as ``truncate_calls`` does (budget ``prompt + response_len``) and at the turn
    limit; ``obs[0]`` is the prompt."""
    obs, resp = obs[: w.max_turns].copy(), resp[: w.max_turns].copy()
    obs[0] = prompt
    context = np.cumsum(obs + resp) - resp  # each call's prompt length
    budget = prompt + w.response_len
    keep = max(1, int(np.searchsorted(context, budget, side="left")))  # calls whose prompt is below the budget
    obs, resp = obs[:keep], resp[:keep]
    resp[-1] = min(resp[-1], budget - int(context[keep - 1]))
    return obs, resp


def draw(w: Workload, path=None) -> Trajectories:
    """The per-call lengths of the workload (seeded by ``w.seed``)."""
    recorded = [np.asarray(t["steps"], dtype=np.int64).reshape(-1, 2) for t in
                (load_trajectories(path) if path else load_trajectories())]
    rng = np.random.default_rng(w.seed)
    first = rng.integers(0, len(recorded), w.prompts)
    picks = rng.integers(0, len(recorded), w.prompts * w.n)
    obs_all, resp_all, calls, prompts = [], [], [], []
    for b, t in enumerate(picks):  # setup, not timed: one pass over the recorded calls of each trajectory
        steps = recorded[t]
        prompt = min(int(_scaled(recorded[first[b // w.n]][:1, 0], w.token_scale)[0]), w.prompt_len)
        obs = _scaled(np.concatenate([[steps[0, 0]], steps[1:, 0] - steps[:-1, 0] - steps[:-1, 1]]), w.token_scale)
        o, r = _truncated(prompt, obs, _scaled(steps[:, 1], w.token_scale), w)
        obs_all.append(o), resp_all.append(r), calls.append(o.size), prompts.append(prompt)
    calls = np.asarray(calls, dtype=np.int64)
    return Trajectories(np.asarray(prompts, dtype=np.int64), np.concatenate(obs_all), np.concatenate(resp_all), calls,
                        np.cumsum(calls) - calls, np.repeat(np.arange(w.prompts), w.n))


def _segments(tr: Trajectories, rng: np.random.Generator, prompt_tokens: list) -> tuple[np.ndarray, np.ndarray]:
    """Flat token ids of every row (prompt, r0, o1, r1, ...) and their loss mask (1 on responses)."""
    seg_len = np.stack([tr.obs, tr.resp], 1).reshape(-1)
    is_resp = np.tile([False, True], tr.obs.size)
    is_prompt = np.zeros(seg_len.size, dtype=bool)
    is_prompt[2 * tr.start] = True
    ids = rng.integers(1000, 150_000, int(seg_len.sum()))
    kind = np.repeat(np.where(is_prompt, 2, is_resp.astype(np.int64)), seg_len)
    prompt_at = np.flatnonzero(kind == 2)
    ids[prompt_at] = np.concatenate([prompt_tokens[g][:n] for g, n in zip(tr.group, tr.prompt)])
    return ids, kind


def _records(tr: Trajectories, ids: np.ndarray, lp: np.ndarray) -> np.ndarray:
    """``[B]`` object: each row's calls delta-encoded (``{"steps": [...]}``, as ``encode_step_records`` writes)."""
    out = np.empty(tr.calls.size, dtype=object)
    offset = 0
    for b, (s, k) in enumerate(zip(tr.start, tr.calls)):  # setup, not timed
        steps, full = [], 0
        for c in range(s, s + k):
            o, r = int(tr.obs[c]), int(tr.resp[c])
            tail = ids[offset:offset + o].astype(np.int32)
            steps.append({"prompt_prefix_len": full, "prompt_tail_ids": tail,
                          "response_ids": ids[offset + o:offset + o + r].astype(np.int32),
                          "response_logprobs": lp[offset + o:offset + o + r],
                          **({"anchor": observation_anchor(tail)} if o else {})})  # as encode_step_records records
            offset, full = offset + o + r, full + o + r
        out[b] = {"steps": steps}
    return out


def _padded(flat: np.ndarray, lengths: np.ndarray, width: int, left: bool, fill=0) -> torch.Tensor:
    """``[B, width]`` rows of ``flat`` (concatenated, ``lengths`` each), left- or right-aligned."""
    B = lengths.size
    out = np.full((B, width), fill, dtype=flat.dtype)
    col = np.arange(width)[None, :]
    mask = col >= (width - lengths)[:, None] if left else col < lengths[:, None]
    out[mask] = flat
    return torch.from_numpy(out)


def rollout_batch(w: Workload, tr: Trajectories) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """``(tensors, non_tensors)`` of the rollout batch (module docstring)."""
    rng = np.random.default_rng(w.seed + 1)
    prompt_tokens = [rng.integers(1000, 150_000, w.prompt_len) for _ in range(w.prompts)]
    ids, kind = _segments(tr, rng, prompt_tokens)
    lp = np.where(kind == 1, -rng.random(ids.size, dtype=np.float32), 0.0).astype(np.float32)
    rows = tr.row_tokens
    resp_len = rows - tr.prompt
    in_resp = kind != 2
    prompts = _padded(ids[~in_resp], tr.prompt, w.prompt_len, True)
    responses = _padded(ids[in_resp], resp_len, w.response_len, False)
    response_mask = _padded((kind[in_resp] == 1).astype(np.int64), resp_len, w.response_len, False)
    attention_mask = torch.cat([_padded(np.ones(int(tr.prompt.sum()), np.int64), tr.prompt, w.prompt_len, True),
                                _padded(np.ones(int(resp_len.sum()), np.int64), resp_len, w.response_len, False)], 1)
    rm = torch.zeros(tr.calls.size, w.response_len)
    rm[torch.arange(tr.calls.size), torch.from_numpy(resp_len - 1)] = torch.from_numpy(
        (rng.random(tr.calls.size) < 0.5).astype(np.float32))
    tensors = {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
               "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
               "response_mask": response_mask, "rm_scores": rm,
               "rollout_log_probs": _padded(lp[in_resp], resp_len, w.response_len, False, 0.0)}
    uid = np.asarray([f"prompt-{g}" for g in tr.group], dtype=object)
    traj = np.asarray([f"traj-{b:06d}" for b in range(tr.calls.size)], dtype=object)
    return tensors, {"uid": uid, "traj_id": traj, DEFAULT_STEPS_KEY: _records(tr, ids, lp)}
