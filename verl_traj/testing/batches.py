"""The one batch factory of the tests and benchmarks: synthetic RL batches in verl's layout.

* :func:`random_batch`: per-row counts of a step-wise batch (uneven groups, 1..N steps per trajectory,
  lognormal lengths, shuffled rows, optional input padding rows) for the core's property tests;
  :func:`swebench_batch`: the same from the real SWE-bench step lengths.
* :func:`verl_tensors`: any such batch as verl's tensors (left-padded prompts, right-padded
  responses, masks, position ids, rewards, log-probs).
* :func:`rl_batch`: a GRPO batch of ``groups x n`` rows with every field verl's trainer, workers and
  losses read (uniform or long-tailed lengths, masked observation spans, optional step-wise ids),
  as plain dicts or a ``DataProto`` (:func:`as_dataproto`).
* :func:`token_trajectory` / :func:`step_record_batch`: token-in/token-out multi-turn trajectories
  and their step records, for the step-wise expansion.

Pure torch/numpy except :func:`as_dataproto` (imports verl).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from verl_traj.core import build_layout_from_counts
from verl_traj.testing.swebench import DATA_FILE, load_step_rows

__all__ = [
    "RandomBatch",
    "random_batch",
    "swebench_batch",
    "verl_tensors",
    "rl_batch",
    "as_dataproto",
    "token_trajectory",
    "step_record_batch",
]


@dataclass
class RandomBatch:
    """Per-row structure and lengths of a batch (``[B]`` arrays)."""

    uid: np.ndarray  # object str
    traj_id: np.ndarray  # object str
    step_index: np.ndarray  # int64
    is_last_step: np.ndarray  # bool
    prompt_len: np.ndarray  # int64 attended prompt tokens
    response_len: np.ndarray  # int64 attended response tokens
    loss_len: np.ndarray  # int64 loss tokens (<= response_len)
    is_padding: np.ndarray  # bool

    @property
    def num_rows(self) -> int:
        return int(self.uid.shape[0])

    @property
    def num_tokens(self) -> np.ndarray:
        return self.prompt_len + self.response_len

    def layout(self):
        """The core's :class:`~verl_traj.core.BatchLayout` of these rows."""
        return build_layout_from_counts(self.num_tokens, self.loss_len, self.uid, self.traj_id, self.step_index,
                                        self.is_last_step, self.is_padding)


def _with_input_padding(b: RandomBatch, pad_rows: int, rng: np.random.Generator) -> RandomBatch:
    """Append ``pad_rows`` rows flagged padding (old padding left by an earlier plan) and shuffle."""
    k = pad_rows
    cols = dict(
        uid=np.concatenate([b.uid, np.array([f"oldpad{i}" for i in range(k)], dtype=object)]),
        traj_id=np.concatenate([b.traj_id, np.array([f"oldpadt{i}" for i in range(k)], dtype=object)]),
        step_index=np.concatenate([b.step_index, np.zeros(k, dtype=np.int64)]),
        is_last_step=np.concatenate([b.is_last_step, np.ones(k, dtype=bool)]),
        prompt_len=np.concatenate([b.prompt_len, np.ones(k, dtype=np.int64)]),
        response_len=np.concatenate([b.response_len, np.ones(k, dtype=np.int64)]),
        loss_len=np.concatenate([b.loss_len, np.zeros(k, dtype=np.int64)]),
        is_padding=np.concatenate([b.is_padding, np.ones(k, dtype=bool)]),
    )
    perm = rng.permutation(b.num_rows + k)
    return RandomBatch(**{name: col[perm] for name, col in cols.items()})


def random_batch(seed: int, num_groups: int, max_traj_per_group: int, max_steps: int, *,
                 heavy_tail: float = 1.0, max_len: int = 4000, pad_rows: int = 0) -> RandomBatch:
    """Uneven groups (1..max_traj_per_group trajectories), 1..max_steps steps each, lognormal lengths,
    rows shuffled, random (non-dense) ids; ``pad_rows`` rows flagged as (input) padding mixed in."""
    rng = np.random.default_rng(seed)
    traj_group = np.repeat(np.arange(num_groups), rng.integers(1, max_traj_per_group + 1, size=num_groups))
    steps = rng.integers(1, max_steps + 1, size=traj_group.shape[0])
    row_traj = np.repeat(np.arange(traj_group.shape[0]), steps)
    n = row_traj.shape[0]
    step = np.arange(n) - np.repeat(np.cumsum(steps) - steps, steps)
    plen = np.minimum(np.exp(rng.normal(4.0, heavy_tail, size=n)).astype(np.int64) + 1, max_len)
    rlen = np.minimum(np.exp(rng.normal(3.0, heavy_tail, size=n)).astype(np.int64) + 1, max_len)
    loss = np.minimum(rlen, rng.integers(0, rlen + 1))
    perm = rng.permutation(n)
    row_traj, step, plen, rlen, loss = row_traj[perm], step[perm], plen[perm], rlen[perm], loss[perm]
    gid = rng.permutation(num_groups * 7)[:num_groups]
    tid = rng.permutation(traj_group.shape[0] * 5)[: traj_group.shape[0]]
    b = RandomBatch(
        uid=np.array([f"g{gid[g]}" for g in traj_group[row_traj]], dtype=object),
        traj_id=np.array([f"t{tid[t]}" for t in row_traj], dtype=object),
        step_index=step.astype(np.int64), is_last_step=step == (steps[row_traj] - 1),
        prompt_len=plen, response_len=rlen, loss_len=loss, is_padding=np.zeros(n, dtype=bool),
    )
    return _with_input_padding(b, pad_rows, rng) if pad_rows else b


def swebench_batch(path=None) -> RandomBatch:
    """One row per step of the SWE-bench trajectories; uid = consecutive trajectories of one repository."""
    rows = load_step_rows(path or DATA_FILE)
    step = np.asarray(rows["step_index"], dtype=np.int64)
    last = np.ones(step.shape[0], dtype=bool)
    last[:-1] = step[1:] == 0  # the next row starts a new trajectory
    rlen = np.asarray(rows["response_tokens"], dtype=np.int64)
    return RandomBatch(np.asarray(rows["uid"], dtype=object), np.asarray(rows["traj_id"], dtype=object), step, last,
                       np.asarray(rows["prompt_tokens"], dtype=np.int64), rlen, rlen.copy(),
                       np.zeros(step.shape[0], dtype=bool))


def _masks(prompt_len: Any, response_len: Any, loss_len: Any, P: int, R: int):
    """Left-padded prompt mask [B,P], right-padded response mask [B,R], loss mask [B,R] (first loss_len)."""
    cols_p, cols_r = torch.arange(P), torch.arange(R)
    pmask = (cols_p[None, :] >= torch.as_tensor(P - np.asarray(prompt_len))[:, None]).long()
    rmask = (cols_r[None, :] < torch.as_tensor(np.asarray(response_len))[:, None]).long()
    lmask = (cols_r[None, :] < torch.as_tensor(np.asarray(loss_len))[:, None]).long()
    return pmask, rmask, lmask


def verl_tensors(b: RandomBatch, P: Optional[int] = None, R: Optional[int] = None, mrope: int = 0,
                 seed: int = 0) -> dict[str, torch.Tensor]:
    """verl layout of ``b``: prompts, responses, input_ids, attention_mask, position_ids (``[B, mrope, L]``
    when ``mrope``), response_mask, rm_scores, rollout_log_probs, routed_experts."""
    n = b.num_rows
    P = int(b.prompt_len.max()) if P is None else P
    R = int(b.response_len.max()) if R is None else R
    pmask, rmask, lmask = _masks(b.prompt_len, b.response_len, b.loss_len, P, R)
    attn = torch.cat([pmask, rmask], dim=1)
    pos = torch.clamp(torch.cumsum(attn, dim=-1) - 1, min=0)
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, 100, (n, P), generator=g) * pmask
    responses = torch.randint(1, 100, (n, R), generator=g) * rmask
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attn,
        "position_ids": pos.unsqueeze(1).expand(n, mrope, P + R).contiguous() if mrope else pos,
        "response_mask": lmask,
        "rm_scores": torch.rand(n, R, generator=g),
        "rollout_log_probs": -torch.rand(n, R, generator=g),
        "routed_experts": torch.randint(0, 8, (n, P + R, 2, 2), generator=g, dtype=torch.int32),
    }


def _lengths(rng: np.random.Generator, count: int, low: int, high: int, long_tail: bool) -> np.ndarray:
    if long_tail:  # multi-turn agents: most responses short, a few near the budget
        return np.clip(rng.lognormal(mean=np.log(high / 6), sigma=0.9, size=count), low, high).astype(np.int64)
    return rng.integers(low, high + 1, size=count).astype(np.int64)


def _loss_mask(rng: np.random.Generator, rmask: torch.Tensor, obs_spans: int) -> torch.Tensor:
    """Response mask with up to ``obs_spans`` masked observation (tool output) spans per row; the first
    response token always carries loss."""
    mask = rmask.clone()
    for i in range(mask.shape[0]):
        length = int(rmask[i].sum())
        for _ in range(int(rng.integers(0, obs_spans + 1)) if obs_spans else 0):
            a = int(rng.integers(0, max(length, 1)))
            mask[i, a: min(a + int(rng.integers(1, 8)), length)] = 0
        if length:
            mask[i, 0] = 1
    return mask


def _step_ids(uid: np.ndarray, n: int, steps_per_traj: int) -> dict[str, np.ndarray]:
    """Trajectories of ``steps_per_traj`` consecutive rows within each group of ``n`` rows."""
    member = np.arange(uid.shape[0]) % n
    traj = np.array([f"{u}_t{m // steps_per_traj}" for u, m in zip(uid, member)], dtype=object)
    step = (member % steps_per_traj).astype(np.int64)
    last = (step == steps_per_traj - 1) | (member == n - 1)
    return {"traj_id": traj, "step_index": step, "is_last_step": last}


def rl_batch(groups: int, n: int, *, prompt_len: int = 5, response_len: int = 6, seed: int = 0,
             long_tail: bool = False, obs_spans: int = 0, steps_per_traj: int = 0,
             vocab: int = 50) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """A GRPO batch of ``groups x n`` rows (``uid`` per group) with what the trainer, workers and losses
    read: tokens, masks, position ids, ``token_level_scores`` / ``token_level_rewards`` (0/1 outcome on
    the last response token), ``old_log_probs``, ``ref_log_prob``, ``advantages``, ``values``,
    ``returns``. ``steps_per_traj > 0`` adds step-wise ``traj_id`` / ``step_index`` / ``is_last_step``."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    B, P, R = groups * n, prompt_len, response_len
    lp = _lengths(rng, B, max(1, P // 2), P, False)
    lr = _lengths(rng, B, 1, R, long_tail)
    pmask, rmask, _ = _masks(lp, lr, lr, P, R)
    attn = torch.cat([pmask, rmask], 1)
    mask = _loss_mask(rng, rmask, obs_spans)
    input_ids = torch.randint(3, vocab, (B, P + R), generator=g) * attn
    scores = torch.zeros(B, R)
    scores[torch.arange(B), torch.as_tensor(lr - 1)] = (torch.rand(B, generator=g) > 0.5).float()
    tensors = {
        "input_ids": input_ids, "prompts": input_ids[:, :P].clone(), "responses": input_ids[:, P:].clone(),
        "attention_mask": attn, "position_ids": torch.clamp(torch.cumsum(attn, -1) - 1, min=0),
        "response_mask": mask, "token_level_scores": scores, "token_level_rewards": scores.clone(),
        "old_log_probs": -torch.rand(B, R, generator=g) * 2 * mask, "ref_log_prob": -torch.rand(B, R, generator=g),
        "advantages": (torch.randn(B, 1, generator=g) * mask).contiguous(),
        "values": torch.randn(B, R, generator=g) * 0.5, "returns": torch.randn(B, R, generator=g),
    }
    uid = np.array([f"u{i // n}" for i in range(B)], dtype=object)
    non_tensors = {"uid": uid, "multi_modal_inputs": np.array([{} for _ in range(B)], dtype=object)}
    if steps_per_traj:
        non_tensors.update(_step_ids(uid, n, steps_per_traj))
    return tensors, non_tensors


def as_dataproto(tensors: dict[str, torch.Tensor], non_tensors: dict[str, np.ndarray]):
    """verl ``DataProto`` of the dicts (``meta_info["global_token_num"]`` as verl's ``fit`` sets it)."""
    # local: batches.py is pure torch/numpy (module doc): the core's property tests use it without importing verl
    from verl import DataProto

    gtn = tensors["attention_mask"].sum(-1).tolist()
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info={"global_token_num": gtn})


def token_trajectory(rng: np.random.Generator, n_steps: int, break_at: Optional[int] = None, min_obs: int = 0,
                     prompt: Optional[torch.Tensor] = None, obs_vocab: int = 100):
    """A token-in/token-out chain: prompt, then (response, observation)*. Returns ``(records, prompt,
    response, response_mask, log_probs)``: one record per LLM call (the context it saw, its tokens and
    log-probs) and the concatenated row. ``break_at``: the context is rewritten before that step; ``prompt``: the
    first call's context (a GRPO group's shared prompt; default random); observations are drawn from ``obs_vocab``
    token ids (a small vocabulary makes trajectories meet the same observations: GiGPO's anchor states)."""
    prompt = torch.randint(1, 100, (int(rng.integers(2, 6)),)) if prompt is None else prompt
    ctx = prompt.clone()
    records, resp, mask, lps = [], [], [], []
    for k in range(n_steps):
        if break_at is not None and k == break_at:
            ctx = torch.cat([prompt, torch.randint(1, 100, (2,))])
        r = torch.randint(100, 200, (int(rng.integers(1, 5)),))
        lp = -torch.rand(r.numel()) - 0.01
        records.append({"prompt_ids": ctx.tolist(), "response_ids": r.tolist(), "response_logprobs": lp.tolist()})
        last = k == n_steps - 1
        obs = torch.zeros(0, dtype=torch.long) if last else torch.randint(200, 200 + obs_vocab,
                                                                         (int(rng.integers(min_obs, 4)),))
        resp += [r, obs]
        mask += [torch.ones(r.numel(), dtype=torch.long), torch.zeros(obs.numel(), dtype=torch.long)]
        lps += [lp, torch.zeros(obs.numel())]
        ctx = torch.cat([ctx, r, obs])
    return records, prompt, torch.cat(resp), torch.cat(mask), torch.cat(lps)


def step_record_batch(trajs: list, uids: list, rewards: list, P: int = 12, R: int = 40, pad: int = 0,
                      with_records: bool = True, traj_ids: bool = True):
    """One row per :func:`token_trajectory` in verl's layout, its step records in ``traj_steps``."""
    B = len(trajs)
    prompts, responses = torch.full((B, P), pad), torch.full((B, R), pad)
    resp_mask, lps, attn, rm = (torch.zeros(B, R, dtype=torch.long), torch.zeros(B, R),
                                torch.zeros(B, P + R, dtype=torch.long), torch.zeros(B, R))
    for b, (_, p, r, m, lp) in enumerate(trajs):
        prompts[b, P - p.numel():] = p
        responses[b, : r.numel()] = r
        resp_mask[b, : r.numel()] = m
        lps[b, : r.numel()] = lp
        attn[b, P - p.numel(): P + r.numel()] = 1
        rm[b, r.numel() - 1] = rewards[b]
    tensors = {"prompts": prompts, "responses": responses, "response_mask": resp_mask, "rollout_log_probs": lps,
               "attention_mask": attn, "input_ids": torch.cat([prompts, responses], 1),
               "position_ids": torch.clip(attn.cumsum(-1) - 1, min=0), "rm_scores": rm}
    recs = np.empty(B, dtype=object)
    recs[:] = [t[0] if with_records else None for t in trajs]
    non = {"uid": np.array(uids, dtype=object), "data_source": np.array(["d"] * B, dtype=object), "traj_steps": recs}
    if traj_ids:
        non["traj_id"] = np.array([f"T{b}" for b in range(B)], dtype=object)
    return tensors, non
