"""Random step-wise batches for the core tests (uneven groups, 1-50 steps, heavy-tailed lengths)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from swebench_data import DATA_FILE, load_step_rows  # noqa: E402


@dataclass
class RandomBatch:
    uid: np.ndarray  # [B] object str
    traj_id: np.ndarray  # [B] object str
    step_index: np.ndarray  # [B] int64
    is_last_step: np.ndarray  # [B] bool
    prompt_len: np.ndarray  # [B] int64 attended prompt tokens
    response_len: np.ndarray  # [B] int64 attended response tokens
    loss_len: np.ndarray  # [B] int64 loss tokens (<= response_len)
    is_padding: np.ndarray  # [B] bool

    @property
    def num_rows(self) -> int:
        return int(self.uid.shape[0])

    @property
    def num_tokens(self) -> np.ndarray:
        return self.prompt_len + self.response_len


def random_batch(
    seed: int,
    num_groups: int,
    max_traj_per_group: int,
    max_steps: int,
    *,
    heavy_tail: float = 1.0,
    max_len: int = 4000,
    pad_rows: int = 0,
) -> RandomBatch:
    """Uneven groups (1..max_traj_per_group trajectories), 1..max_steps steps each, lognormal lengths,
    rows shuffled; ``pad_rows`` rows flagged as (input) padding mixed in."""
    rng = np.random.default_rng(seed)
    n_traj = rng.integers(1, max_traj_per_group + 1, size=num_groups)
    traj_group = np.repeat(np.arange(num_groups), n_traj)
    T = traj_group.shape[0]
    steps = rng.integers(1, max_steps + 1, size=T)
    row_traj = np.repeat(np.arange(T), steps)
    B = row_traj.shape[0]
    step = np.arange(B) - np.repeat(np.cumsum(steps) - steps, steps)
    plen = np.minimum(np.exp(rng.normal(4.0, heavy_tail, size=B)).astype(np.int64) + 1, max_len)
    rlen = np.minimum(np.exp(rng.normal(3.0, heavy_tail, size=B)).astype(np.int64) + 1, max_len)
    loss = np.minimum(rlen, rng.integers(0, rlen + 1))
    perm = rng.permutation(B)
    row_traj, step, plen, rlen, loss = row_traj[perm], step[perm], plen[perm], rlen[perm], loss[perm]
    # random (non-dense) ids
    gid = rng.permutation(num_groups * 7)[:num_groups]
    tid = rng.permutation(T * 5)[:T]
    uid = np.array([f"g{gid[g]}" for g in traj_group[row_traj]], dtype=object)
    traj_id = np.array([f"t{tid[t]}" for t in row_traj], dtype=object)
    last = step == (steps[row_traj] - 1)
    pad = np.zeros(B, dtype=bool)
    if pad_rows:
        uid = np.concatenate([uid, np.array([f"oldpad{k}" for k in range(pad_rows)], dtype=object)])
        traj_id = np.concatenate([traj_id, np.array([f"oldpadt{k}" for k in range(pad_rows)], dtype=object)])
        step = np.concatenate([step, np.zeros(pad_rows, dtype=np.int64)])
        last = np.concatenate([last, np.ones(pad_rows, dtype=bool)])
        plen = np.concatenate([plen, np.ones(pad_rows, dtype=np.int64)])
        rlen = np.concatenate([rlen, np.ones(pad_rows, dtype=np.int64)])
        loss = np.concatenate([loss, np.zeros(pad_rows, dtype=np.int64)])
        pad = np.concatenate([pad, np.ones(pad_rows, dtype=bool)])
        p2 = rng.permutation(uid.shape[0])
        uid, traj_id, step, last, plen, rlen, loss, pad = (a[p2] for a in (uid, traj_id, step, last, plen, rlen, loss, pad))
    return RandomBatch(uid, traj_id, step.astype(np.int64), last, plen, rlen, loss, pad)


def to_verl_tensors(b: RandomBatch, P: Optional[int] = None, R: Optional[int] = None, mrope: int = 0) -> dict[str, torch.Tensor]:
    """verl layout: left-padded prompts [B,P], right-padded responses [B,R], masks and position ids."""
    B = b.num_rows
    P = int(b.prompt_len.max()) if P is None else P
    R = int(b.response_len.max()) if R is None else R
    cols_p = torch.arange(P)
    cols_r = torch.arange(R)
    pmask = (cols_p[None, :] >= torch.as_tensor(P - b.prompt_len)[:, None]).long()
    rmask = (cols_r[None, :] < torch.as_tensor(b.response_len)[:, None]).long()
    lmask = (cols_r[None, :] < torch.as_tensor(b.loss_len)[:, None]).long()
    attn = torch.cat([pmask, rmask], dim=1)
    pos = torch.clamp(torch.cumsum(attn, dim=-1) - 1, min=0)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, 100, (B, P), generator=g) * pmask
    responses = torch.randint(1, 100, (B, R), generator=g) * rmask
    out = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attn,
        "position_ids": pos.unsqueeze(1).expand(B, mrope, P + R).contiguous() if mrope else pos,
        "response_mask": lmask,
        "rm_scores": torch.rand(B, R, generator=g),
        "rollout_log_probs": -torch.rand(B, R, generator=g),
        "routed_experts": torch.randint(0, 8, (B, P + R, 2, 2), generator=g, dtype=torch.int32) if B else torch.zeros(0),
    }
    return out


def load_swebench(path: Path = DATA_FILE) -> RandomBatch:
    """One row per step; uid = consecutive trajectories of the same repository (id prefix before '__')."""
    rows = load_step_rows(path)
    uid, tid, step = rows["uid"], rows["traj_id"], rows["step_index"]
    plen, rlen = rows["prompt_tokens"], rows["response_tokens"]
    step_a = np.asarray(step, dtype=np.int64)
    tid_a = np.asarray(tid, dtype=object)
    rlen_a = np.asarray(rlen, dtype=np.int64)
    # last step: next row starts a new trajectory
    last = np.ones(len(tid), dtype=bool)
    last[:-1] = step_a[1:] == 0
    return RandomBatch(
        np.asarray(uid, dtype=object), tid_a, step_a, last, np.asarray(plen, dtype=np.int64), rlen_a, rlen_a.copy(),
        np.zeros(len(tid), dtype=bool),
    )
