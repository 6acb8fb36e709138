"""Shared harness for the gradient-equivalence tests: a tiny LM, synthetic RL rows, and a faithful
emulation of verl's FSDP engine step (verl's own ``left_right_2_no_padding`` and
``prepare_micro_batches`` with a token cap, one ``loss.backward()`` per micro-batch, then the DP
all-reduce-average of gradients that FSDP performs)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

P, R, VOCAB, D = 6, 8, 23, 16


def patch_verl_device(monkeypatch=None) -> None:
    """verl picks 'cuda' as device name on a machine without an accelerator unless the CPU platform
    plugin is loaded; the micro-batch count sync must run on CPU tensors here. In the pytest process pass
    ``monkeypatch`` (restored after the test); a spawned rank process sets it for its own short life."""
    import verl.utils.seqlen_balancing as sb

    if monkeypatch is not None:
        monkeypatch.setattr(sb, "get_device_name", lambda: "cpu")
    else:
        sb.get_device_name = lambda: "cpu"


class TinyLM(nn.Module):
    """Embedding + previous-token mixing + LM head + value head (context of one previous token)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Parameter(torch.randn(VOCAB, D, generator=g) * 0.5)
        self.mix = nn.Parameter(torch.randn(D, D, generator=g) * 0.3)
        self.head = nn.Parameter(torch.randn(D, VOCAB, generator=g) * 0.3)
        self.vhead = nn.Parameter(torch.randn(D, generator=g) * 0.3)

    def forward_flat(self, ids: torch.Tensor, offsets: torch.Tensor) -> dict[str, torch.Tensor]:
        """ids: flat [nnz] tokens of concatenated sequences (no padding); offsets [b+1].
        Returns flat per-position outputs in verl's convention: position j holds the log-prob of
        token j+1 (the value at j is V(s_j))."""
        h0 = self.emb[ids]
        prev = torch.roll(h0, 1, 0)
        starts = torch.zeros(ids.shape[0], dtype=torch.bool)
        starts[offsets[:-1]] = True
        prev = torch.where(starts[:, None], torch.zeros_like(prev), prev)
        h = torch.tanh(h0 + prev @ self.mix)
        logp = torch.log_softmax(h @ self.head, -1)
        nxt = torch.roll(ids, -1, 0)
        log_probs = logp.gather(-1, nxt[:, None]).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        values = h @ self.vhead
        return {"log_probs": log_probs, "entropy": entropy, "values": values}


def make_rows(n_real: int, n_pad: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded prompts, right-padded responses; response_mask has holes (multi-turn observation
    tokens); then ``n_pad`` padding rows appended: verl_traj's minimal rows (2 attended tokens, last
    prompt position + first response position, response_mask all 0). The real rows do not depend on
    ``n_pad``."""
    g = torch.Generator().manual_seed(seed)
    B = n_real
    prompts = torch.zeros(B, P, dtype=torch.long)
    responses = torch.zeros(B, R, dtype=torch.long)
    attn = torch.zeros(B, P + R, dtype=torch.long)
    resp_mask = torch.zeros(B, R, dtype=torch.long)
    for i in range(B):
        lp = int(torch.randint(1, P + 1, (1,), generator=g))
        lr = int(torch.randint(1, R + 1, (1,), generator=g))
        prompts[i, P - lp:] = torch.randint(1, VOCAB, (lp,), generator=g)
        responses[i, :lr] = torch.randint(1, VOCAB, (lr,), generator=g)
        attn[i, P - lp: P + lr] = 1
        m = (torch.rand(lr, generator=g) > 0.25).long()
        m[0] = 1
        resp_mask[i, :lr] = m
    rows = {
        "prompts": prompts,
        "responses": responses,
        "attention_mask": attn,
        "response_mask": resp_mask,
        "advantages": torch.randn(B, R, generator=g) * resp_mask,
        "ref_log_prob": -torch.rand(B, R, generator=g) * 3,
        "values": torch.randn(B, R, generator=g) * 0.5,
        "returns": torch.randn(B, R, generator=g),
        "traj_index": torch.randint(0, max(1, n_real // 2), (B,), generator=g),
        "is_padding": torch.zeros(B, dtype=torch.bool),
        "mini_batch_id": torch.zeros(B, dtype=torch.long),
        "old_noise": torch.randn(B, R, generator=g) * 0.3,
    }
    if n_pad:
        pad = {k: torch.zeros((n_pad,) + v.shape[1:], dtype=v.dtype) for k, v in rows.items()}
        pad["prompts"][:, P - 1] = 1
        pad["responses"][:, 0] = 2
        pad["attention_mask"][:, P - 1: P + 1] = 1
        pad["traj_index"] = 1000 + torch.arange(n_pad)
        pad["is_padding"][:] = True
        rows = {k: torch.cat([rows[k], pad[k]]) for k in rows}
    rows["input_ids"] = torch.cat([rows["prompts"], rows["responses"]], -1)
    rows["position_ids"] = torch.clamp(torch.cumsum(rows["attention_mask"], -1) - 1, min=0)
    # old log-probs near the current policy's, so that some ratios clip
    with torch.no_grad():
        from verl.workers.utils.padding import no_padding_2_padding

        out = TinyLM().forward_flat(*_flat(rows["input_ids"], rows["attention_mask"]))
        lp = no_padding_2_padding(out["log_probs"], _to_engine_td(rows))
    rows["old_log_probs"] = (lp + rows.pop("old_noise")) * rows["response_mask"]
    return rows


def _flat(input_ids: torch.Tensor, attn: torch.Tensor):
    lens = attn.sum(-1)
    offsets = torch.zeros(len(lens) + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lens, 0)
    return input_ids[attn.bool()], offsets


def _to_engine_td(rows: dict[str, torch.Tensor]):
    from tensordict import TensorDict

    from verl.workers.utils.padding import left_right_2_no_padding

    B = rows["input_ids"].shape[0]
    keep = {k: v.clone() for k, v in rows.items() if k not in ("traj_index", "is_padding", "old_noise")}
    td = TensorDict(keep, batch_size=[B])
    return left_right_2_no_padding(td)


def select_rows(rows: dict[str, torch.Tensor], idx) -> dict[str, torch.Tensor]:
    idx = torch.as_tensor(idx, dtype=torch.long)
    return {k: v[idx] for k, v in rows.items()}


def planned_micro_batch_ids(rows: dict[str, torch.Tensor], cap: int, cost: str = "tokens") -> torch.Tensor:
    """This rank's micro-batch ids as the planner packs them (one block: one mini-batch on one rank)."""
    import numpy as np

    from verl_traj.core import pack_micro_batches

    tokens = rows["attention_mask"].sum(-1).numpy()
    packing = pack_micro_batches(tokens, np.zeros(len(tokens), dtype=np.int64), np.zeros(1, dtype=np.int64), 1, cap,
                                 cost=cost)
    return torch.from_numpy(packing.micro_index)


def engine_step(
    model: TinyLM,
    rows: dict[str, torch.Tensor],
    kind: str,
    loss_fn,
    config,
    *,
    max_token_len: int,
    dp_size: int,
    dp_group=None,
    planned: str = "",
) -> int:
    """One verl FSDP-engine ``forward_backward_batch`` on this rank's rows (grads accumulate in
    ``model``), then the DP gradient average. Returns the number of micro-batches. ``planned``: cut the
    micro-batches with the planner (``"tokens"`` / ``"padded"`` cost) and run them through the worker's
    micro-batch hook instead of verl's ``prepare_micro_batches``."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches

    from verl_traj.core.keys import planned_update_fields
    from verl_traj.integration.workers.engine_workers import PlannedUpdate

    if planned:
        rows = {**rows, "micro_batch_id": planned_micro_batch_ids(rows, max_token_len, planned)}
    td = _to_engine_td(rows)
    tu.assign_non_tensor(
        td, dp_size=dp_size, batch_num_tokens=None, global_batch_size=None, use_dynamic_bsz=True,
        max_token_len_per_gpu=max_token_len, sp_size=1,
    )
    cut = (PlannedUpdate(seed=0, fields=planned_update_fields()).prepare_micro_batches(prepare_micro_batches) if planned
           else prepare_micro_batches)
    micro_batches, _ = cut(td, dp_group=dp_group, same_micro_num_in_dp=True)
    for mb in micro_batches:
        ids = mb["input_ids"]
        out = model.forward_flat(ids.values(), ids.offsets())
        offsets = ids.offsets()
        nested = {k: torch.nested.nested_tensor_from_jagged(v, offsets=offsets) for k, v in out.items()}
        if kind == "policy":
            model_output = {"log_probs": nested["log_probs"], "entropy": nested["entropy"]}
        else:
            model_output = {"values": nested["values"]}
        loss, _metrics = loss_fn(config, model_output, mb)
        loss.backward()
    if dp_size > 1:
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=dp_group)
            p.grad /= dp_size
    return len(micro_batches)


def flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in model.parameters()])


def actor_config(use_kl: bool = True, loss_agg_mode: str = "token-mean"):
    from verl.workers.config import ActorConfig

    return ActorConfig(
        strategy="fsdp2", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
        use_kl_loss=use_kl, kl_loss_coef=0.1, kl_loss_type="low_var_kl", entropy_coeff=0.01, clip_ratio=0.2,
        loss_agg_mode=loss_agg_mode,
    )


def critic_config():
    from verl.workers.config import CriticConfig

    return CriticConfig(strategy="fsdp2", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                        cliprange_value=0.2)


def with_loss_weight(rows: dict[str, torch.Tensor], mode: str, scale: Optional[float] = None) -> dict[str, torch.Tensor]:
    from verl_traj.core import compute_loss_weights

    out = dict(rows)
    out["loss_weight"] = compute_loss_weights(
        mode, rows["response_mask"], rows["mini_batch_id"], rows["traj_index"], rows["is_padding"],
        loss_scale_factor=scale,
    )
    return out
