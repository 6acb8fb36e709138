"""Shared builders for step-wise tests: token-in/token-out trajectories in verl's batch layout."""

import numpy as np
import torch

PAD = 0


def make_trajectory(rng, n_steps, break_at=None, min_obs=0):
    """Token-in/token-out chain: prompt, then (response, observation)*; returns records + concatenated row."""
    prompt = torch.randint(1, 100, (int(rng.integers(2, 6)),))
    ctx = prompt.clone()
    records, resp_parts, mask_parts, lp_parts = [], [], [], []
    for k in range(n_steps):
        if break_at is not None and k == break_at:
            ctx = torch.cat([prompt, torch.randint(1, 100, (2,))])  # context rewritten
        r = torch.randint(100, 200, (int(rng.integers(1, 5)),))
        lp = -torch.rand(r.numel()) - 0.01
        records.append({"prompt_ids": ctx.tolist(), "response_ids": r.tolist(), "response_logprobs": lp.tolist()})
        obs = torch.randint(200, 300, (int(rng.integers(min_obs, 4)),)) if k < n_steps - 1 else torch.zeros(0, dtype=torch.long)
        resp_parts += [r, obs]
        mask_parts += [torch.ones(r.numel(), dtype=torch.long), torch.zeros(obs.numel(), dtype=torch.long)]
        lp_parts += [lp, torch.zeros(obs.numel())]
        ctx = torch.cat([ctx, r, obs])
    return records, prompt, torch.cat(resp_parts), torch.cat(mask_parts), torch.cat(lp_parts)


def make_batch(trajs, uids, rewards, P=12, R=40, with_records=True, traj_ids=True):
    B = len(trajs)
    prompts = torch.full((B, P), PAD)
    responses = torch.full((B, R), PAD)
    resp_mask = torch.zeros(B, R, dtype=torch.long)
    lps = torch.zeros(B, R)
    attn = torch.zeros(B, P + R, dtype=torch.long)
    rm = torch.zeros(B, R)
    for b, (_, p, r, m, lp) in enumerate(trajs):
        prompts[b, P - p.numel():] = p
        responses[b, : r.numel()] = r
        resp_mask[b, : r.numel()] = m
        lps[b, : r.numel()] = lp
        attn[b, P - p.numel(): P + r.numel()] = 1
        rm[b, r.numel() - 1] = rewards[b]
    tensors = {
        "prompts": prompts, "responses": responses, "response_mask": resp_mask, "rollout_log_probs": lps,
        "attention_mask": attn, "input_ids": torch.cat([prompts, responses], 1),
        "position_ids": torch.clip(attn.cumsum(-1) - 1, min=0), "rm_scores": rm,
    }
    recs = np.empty(B, dtype=object)
    recs[:] = [t[0] if with_records else None for t in trajs]
    non = {"uid": np.array(uids, dtype=object), "data_source": np.array(["d"] * B, dtype=object), "traj_steps": recs}
    if traj_ids:
        non["traj_id"] = np.array([f"T{b}" for b in range(B)], dtype=object)
    return tensors, non
