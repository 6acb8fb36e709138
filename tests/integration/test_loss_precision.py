"""Loss weights are applied in fp32 whatever the dtype of the log-probs and values (bf16 under autocast or verl's
full determinism). Regression of issue 21: the weights were cast to that dtype, and bf16 rounds a weight of 1/3 to
0.333984 (+0.2%), so seq-mean and traj-mean losses were off per row."""

from __future__ import annotations

import torch

from tests.integration import grad_harness as H
from verl_traj.integration.workers.losses import weighted_policy_loss, weighted_value_loss

B, R = 3, 5
WEIGHTS = torch.tensor([1 / 3, 1 / 7, 1 / 768], dtype=torch.float32)  # none is a bf16 number


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    log_prob = (-torch.rand(B, R, generator=g)).to(dtype)  # values bf16 holds exactly: the test isolates the weights
    mask = torch.ones(B, R, dtype=torch.bool)
    mask[1, 3:] = False
    return dict(log_prob=log_prob, old_log_prob=log_prob.detach().clone(), advantages=torch.ones(B, R, dtype=dtype),
                ref_log_prob=log_prob.detach().clone(), entropy=torch.ones(B, R, dtype=dtype), response_mask=mask)


def test_policy_loss_weights_stay_fp32_with_bf16_log_probs(monkeypatch):
    H.patch_verl_device(monkeypatch)
    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        kw = _inputs(dtype)
        kw["log_prob"] = kw["log_prob"].float().to(dtype).requires_grad_(True)
        loss, _ = weighted_policy_loss(H.actor_config(use_kl=True), loss_weight=WEIGHTS, dp_size=1, **kw)
        losses[dtype] = loss.detach().double()
    # the per-token terms are exact in both dtypes here; only the weights could differ
    torch.testing.assert_close(losses[torch.bfloat16], losses[torch.float32], rtol=1e-6, atol=1e-7)


def test_value_loss_weights_stay_fp32_with_bf16_values():
    from verl.workers.config import CriticConfig

    config = CriticConfig(strategy="fsdp2", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                          cliprange_value=1.0)
    g = torch.Generator().manual_seed(1)
    # quarters: every difference and square below is exact in bf16, so only the weights could differ
    returns = torch.randint(1, 5, (B, R), generator=g).float() / 4
    values = torch.zeros(B, R)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        vpreds = returns.to(dtype) * 0.5  # exact in bf16
        loss, _ = weighted_value_loss(config, vpreds=vpreds, values=values.to(dtype), returns=returns.to(dtype),
                                      response_mask=torch.ones(B, R, dtype=torch.bool), loss_weight=WEIGHTS, dp_size=1)
        out[dtype] = loss.double()
    vpreds = returns * 0.5  # verl's clipped value loss, in float64, with the fp32 weights
    clipped = values + (vpreds - values).clamp(-1.0, 1.0)
    per_token = 0.5 * torch.maximum((vpreds - returns) ** 2, (clipped - returns) ** 2).double()
    torch.testing.assert_close(out[torch.float32], (per_token * WEIGHTS.double()[:, None]).sum(), rtol=1e-6, atol=0)
    torch.testing.assert_close(out[torch.bfloat16], out[torch.float32], rtol=1e-6, atol=1e-8)
