"""Per-row loss weights: every loss aggregation mode as one weighted token sum.

Pure module (torch only). The trainer computes ``loss_weight`` (float32, one value per row) once per
training step on the driver and attaches it to the batch; the loss functions
(``verl_traj.integration.losses``) then aggregate every loss term ``loss_t`` (policy, entropy, KL,
value) of a mini-batch ``m`` as

    loss(m) = sum_{rows i in m} sum_t  loss_{i,t} * response_mask_{i,t} * w_i

(verl's ``agg_loss(..., loss_agg_mode="token-sum", dp_size=...)`` with the weighted mask; the
``* dp_size`` there cancels the DP gradient averaging of FSDP). Because ``w_i`` already holds the
mini-batch-global normaliser, the gradient of a mini-batch does not depend on how its rows are spread
over DP ranks or cut into micro-batches, and padding rows (``w = 0``) contribute nothing.

Notation, for the mini-batch ``m`` that row ``i`` belongs to (``mini_batch_id[i] == m``); only
*real* rows (``is_padding == False``) enter any statistic:

* ``l_i``   = loss tokens of row i = ``response_mask[i].sum()``
* ``N_m``   = number of real rows in m (rows with ``l_i == 0`` included, as verl's
  ``global_batch_size`` counts every row)
* ``L_m``   = sum of ``l_i`` over the real rows of m
* ``T_m``   = number of distinct trajectories (``traj_index``) with a real row in m
* ``L_k``   = sum of ``l_i`` over the real rows of trajectory k (in m)
* ``S``     = ``loss_scale_factor`` if given, else the response width ``R = response_mask.shape[1]``

Formulas (``w_i = 0`` for padding rows, and wherever the formula divides by a zero count):

- ``token-mean``:              ``w_i = 1 / L_m``            (mean over all loss tokens of the mini-batch)
- ``seq-mean-token-sum``:      ``w_i = 1 / N_m``            (mean over rows of each row's token sum)
- ``seq-mean-token-mean``:     ``w_i = 1 / (N_m * l_i)``    (mean over rows of each row's token mean)
- ``seq-mean-token-sum-norm``: ``w_i = 1 / (N_m * S)``      (row token sums divided by a constant S,
  mean over rows)
- ``traj-mean``:               ``w_i = 1 / (T_m * L_k(i))`` (k(i) = trajectory of row i: mean over
  trajectories of each trajectory's token mean over all its step rows together; every trajectory
  weighs the same whatever its number of steps/rows)

Differences from verl's own ``agg_loss``: the statistics are those of the real mini-batch (verl uses
the configured ``ppo_mini_batch_size * n`` row count, which counts padding and is wrong for
variable-size mini-batches), and ``seq-mean-token-sum-norm`` uses a constant ``S`` (verl falls back
to the current micro-batch's padded width, which varies between micro-batches).
With one row per trajectory, ``traj-mean`` equals ``seq-mean-token-mean``.
"""

from __future__ import annotations

from typing import Optional

import torch

LOSS_WEIGHT_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
    "traj-mean",
)


def _safe_reciprocal(x: torch.Tensor) -> torch.Tensor:
    """1/x where x > 0, else 0 (float64)."""
    out = torch.zeros_like(x, dtype=torch.float64)
    pos = x > 0
    out[pos] = 1.0 / x[pos].to(torch.float64)
    return out


def compute_loss_weights(
    mode: str,
    response_mask: torch.Tensor,
    mini_batch_id: torch.Tensor,
    traj_index: torch.Tensor,
    is_padding: torch.Tensor,
    *,
    loss_scale_factor: Optional[float] = None,
) -> torch.Tensor:
    """Per-row weights ``w`` (float32 [B]) such that ``sum(loss * response_mask * w[:, None])`` over a
    mini-batch is that mini-batch's loss under aggregation ``mode`` (formulas: module docstring).

    Args:
        mode: one of ``LOSS_WEIGHT_MODES``.
        response_mask: [B, R] (bool/int/float; non-zero = loss token).
        mini_batch_id: [B] integer id of each row's mini-batch (any integers).
        traj_index: [B] integer trajectory of each row (only used by ``traj-mean``).
        is_padding: [B] bool; padding rows get weight 0 and enter no statistic.
        loss_scale_factor: ``S`` of ``seq-mean-token-sum-norm`` (default: ``R``).
    """
    if mode not in LOSS_WEIGHT_MODES:
        raise ValueError(
            f"loss aggregation mode {mode!r} is not one of {list(LOSS_WEIGHT_MODES)}; set traj.loss_agg_mode "
            "(or actor/critic loss_agg_mode) to one of them."
        )
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be [B, R], got shape {tuple(response_mask.shape)}")
    B, R = response_mask.shape
    for name, t in (("mini_batch_id", mini_batch_id), ("traj_index", traj_index), ("is_padding", is_padding)):
        if t.shape != (B,):
            raise ValueError(f"{name} must have shape [{B}] (one value per row), got {tuple(t.shape)}")
    device = response_mask.device
    real = ~is_padding.to(device=device, dtype=torch.bool)
    realf = real.to(torch.float64)
    row_tokens = (response_mask != 0).sum(-1).to(torch.float64) * realf  # l_i (0 for padding)

    _, mb = torch.unique(mini_batch_id.to(device), return_inverse=True)
    num_mb = int(mb.max().item()) + 1 if B > 0 else 0

    def per_mb_sum(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(num_mb, dtype=torch.float64, device=device).index_add_(0, mb, values)

    if mode == "token-mean":
        w = _safe_reciprocal(per_mb_sum(row_tokens))[mb]
    elif mode in ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        w = _safe_reciprocal(per_mb_sum(realf))[mb]
        if mode == "seq-mean-token-mean":
            w = w * _safe_reciprocal(row_tokens)
        elif mode == "seq-mean-token-sum-norm":
            scale = float(loss_scale_factor) if loss_scale_factor is not None else float(R)
            if scale <= 0:
                raise ValueError(f"loss_scale_factor must be positive, got {loss_scale_factor!r}")
            w = w / scale
    else:  # traj-mean
        # (mini-batch, trajectory) pairs: robust even if a trajectory were split over mini-batches.
        _, traj_dense = torch.unique(traj_index.to(device), return_inverse=True)
        num_traj = int(traj_dense.max().item()) + 1 if B > 0 else 0
        pair = mb * max(num_traj, 1) + traj_dense
        _, pair_dense = torch.unique(pair, return_inverse=True)
        num_pairs = int(pair_dense.max().item()) + 1 if B > 0 else 0
        pair_tokens = torch.zeros(num_pairs, dtype=torch.float64, device=device).index_add_(0, pair_dense, row_tokens)
        pair_real = torch.zeros(num_pairs, dtype=torch.float64, device=device).index_add_(0, pair_dense, realf)
        pair_mb = torch.zeros(num_pairs, dtype=torch.long, device=device).scatter_(0, pair_dense, mb)
        traj_per_mb = torch.zeros(num_mb, dtype=torch.float64, device=device).index_add_(
            0, pair_mb, (pair_real > 0).to(torch.float64)
        )
        w = _safe_reciprocal(traj_per_mb)[mb] * _safe_reciprocal(pair_tokens)[pair_dense]
    w = w * realf
    return w.to(torch.float32)


__all__ = ["LOSS_WEIGHT_MODES", "compute_loss_weights"]
