"""Step-wise test helpers: the plan's dense trajectory index for hand-written rows, and the advantage
call the trainer makes with it."""

from __future__ import annotations

import numpy as np
import torch

from verl_traj.core import factorize
from verl_traj.stepwise.advantages import compute_trajectory_advantages


def traj_index_of(traj, pad=None) -> torch.Tensor:
    """``[B]`` dense index of ``traj`` (first-appearance order over real rows), ``-1`` on padding rows:
    what ``apply_plan`` carries in the batch as ``traj_index``."""
    traj = np.asarray(traj.numpy() if isinstance(traj, torch.Tensor) else traj, dtype=object)
    pad = np.zeros(traj.shape[0], dtype=bool) if pad is None else np.asarray(pad, dtype=bool)
    out = np.full(traj.shape[0], -1, dtype=np.int64)
    out[~pad] = factorize(traj[~pad].astype(str))[0]
    return torch.from_numpy(out)


def trajectory_advantages(rewards, mask, uid, traj, last, pad=None, **kwargs):
    """``compute_trajectory_advantages`` on rows named by trajectory id; returns ``(adv, ret, traj_adv, traj_index)``."""
    index = traj_index_of(traj, pad)
    adv, ret, traj_adv = compute_trajectory_advantages(rewards, mask, index, last, uid, **kwargs)
    return adv, ret, traj_adv, index
