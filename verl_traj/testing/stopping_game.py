"""A search game where the policy decides when to stop, with its true advantages: the test and the benchmark of
per-turn baselines (``tests/stepwise/test_step_groups.py``, ``scripts/bench_step_baselines.py``)."""

from __future__ import annotations

import numpy as np
import torch

from verl_traj.stepwise.step_groups import (StepCalls, discounted_step_returns, step_group_advantages,
                                            step_group_ids)

__all__ = ["baseline_estimates", "estimate_cells", "stopping_game"]


def stopping_game(groups: int, n: int, turns: int, seed: int, p=0.5, answer=0.8, give_up=0.3, cost=0.1):
    """A search game where the policy decides when to stop. At each turn the observation says whether the answer was
    found (once found it stays found; before, it is found with probability ``p``); found: answer (+1, stop) with
    probability ``answer``, else search on (-cost); not found: give up (0, stop) with probability ``give_up``, else
    search on (-cost); the last turn ends the episode. Returns the calls ``(traj, turn, found, action, reward)`` and
    the true advantage ``Q(s, a) - V(s)`` of each (turn, found, action), by backward induction."""
    rng = np.random.default_rng(seed)
    m = groups * n
    found, alive = np.zeros(m, bool), np.ones(m, bool)
    calls = []
    for k in range(turns):
        found |= alive & (rng.random(m) < p)
        stop = np.where(found, rng.random(m) < answer, rng.random(m) < give_up)
        reward = np.where(stop, np.where(found, 1.0, 0.0), -cost)
        idx = np.flatnonzero(alive)
        calls.append(np.stack([idx, np.full(idx.size, k), found[idx], stop[idx], reward[idx]], 1))
        alive &= ~stop
    v = {(turns, 0): 0.0, (turns, 1): 0.0}
    true = {}
    for k in reversed(range(turns)):
        later = (lambda f: v[(k + 1, f)]) if k < turns - 1 else (lambda f: 0.0)
        q = {(1, 1): 1.0, (1, 0): -cost + later(1), (0, 1): 0.0, (0, 0): -cost + p * later(1) + (1 - p) * later(0)}
        for f, stop_p in ((1, answer), (0, give_up)):
            v[(k, f)] = stop_p * q[(f, 1)] + (1 - stop_p) * q[(f, 0)]
            true.update({(k, f, a): q[(f, a)] - v[(k, f)] for a in (0, 1)})
    return np.concatenate(calls), true


def baseline_estimates(calls: np.ndarray, n: int, key: str, baseline: str, norm_by_std: bool = False) -> np.ndarray:
    """``[S]`` step-level advantage estimates of the game's ``calls`` in GRPO groups of ``n`` trajectories, step groups
    keyed by ``key`` (``"anchor"``: the state (turn, found); ``"turn_index"``: the turn alone, verl RFC 7244's), and
    whether each call had a peer in its group (``[S]`` bool), through :mod:`verl_traj.stepwise.step_groups`."""
    traj, turn, found = (torch.from_numpy(calls[:, i].astype(np.int64)) for i in range(3))
    anchor = 2 * turn + found + 1 if key == "anchor" else turn + 1
    c = StepCalls(row=torch.arange(traj.numel()), anchor=anchor, traj=traj, order=turn,
                  token_call=torch.zeros(0, 0, dtype=torch.long), num_trajectories=int(traj.max()) + 1)
    returns = discounted_step_returns(c, torch.from_numpy(calls[:, 4]), 1.0)
    group = step_group_ids(c, (np.arange(c.num_trajectories) // n).astype(str))
    est = step_group_advantages(returns, group, baseline=baseline, norm_by_std=norm_by_std).numpy()
    return est, torch.bincount(group)[group].numpy() > 1


def estimate_cells(calls: np.ndarray, true: dict, est: np.ndarray, peer: np.ndarray,
                   min_samples: int = 500) -> list[dict]:
    """Per (turn, found, action) with at least ``min_samples`` calls that had a peer: the true advantage, the
    estimates' mean and its standard error."""
    out = []
    for (k, f, a), value in sorted(true.items()):
        sel = peer & (calls[:, 1] == k) & (calls[:, 2] == f) & (calls[:, 3] == a)
        if sel.sum() >= min_samples:
            out.append({"turn": k, "found": f, "action": a, "true": value, "mean": float(est[sel].mean()),
                        "se": float(est[sel].std() / np.sqrt(sel.sum())), "calls": int(sel.sum())})
    return out
