"""Synthetic policy drift for ``scripts/bench_async_bias.py`` (issue 53): the log-ratio ``log(pi_old / pi_rollout)``
of every token a simulated step trains, heavy-tailed, its variance growing with the token's lag.

A token sampled ``k`` policy versions before the trained policy gets ``log w = sqrt(rate * k) * T``, ``T`` a unit-variance
Student-t with 3 degrees of freedom (heavy tails: a few tokens move a lot, as the tokens whose probability an update
changes most do), clipped at verl's safety bound (+-20); a token of the trained policy gets 0 (the simulation has no
rollout/trainer numeric mismatch). ``rate`` is the drift per version and token: a sequence's log-weight then has
variance ``rate * sum over its tokens of k``, so at agent lengths the sequence weight's spread grows with the length
while each token's stays that of its own lag.

Per step, over the trained trajectories: the token weights' health as the trainer logs it
(:func:`~verl_traj.core.rollout.offpolicy.weight_health`, truncation ``C``: verl's ``rollout_is=token``), the same for one
weight per trajectory (the product of its tokens' ratios: what ``rollout_is=sequence`` with
``traj.ratio_scope=trajectory`` weighs), the lag (:func:`~verl_traj.core.rollout.offpolicy.lag_stats`), and the tokens the
truncated weights leave (their sum over the tokens' count).
"""

from __future__ import annotations

import numpy as np
import torch

from verl_traj.core.rollout.offpolicy import lag_stats, weight_health

SAFETY_BOUND = 20.0  # verl's rollout_corr_helper bound on a log-ratio


def token_log_ratios(rng: np.random.Generator, ledgers: list, trained_version: int,
                     rate: float) -> tuple[np.ndarray, np.ndarray]:
    """``(log_ratio [N], trajectory [N])`` of every generated token of ``ledgers`` (one ``[[version, tokens], ...]``
    per trajectory), float32 / int64."""
    owner = np.repeat(np.arange(len(ledgers)), [len(ledger) for ledger in ledgers])
    pairs = np.array([pair for ledger in ledgers for pair in ledger], dtype=np.int64).reshape(-1, 2)
    counts = np.maximum(pairs[:, 1], 0)
    lag = np.repeat(trained_version - pairs[:, 0], counts).astype(np.float32)
    trajectory = np.repeat(owner, counts)
    t = rng.standard_t(3, lag.size).astype(np.float32) / np.sqrt(3.0, dtype=np.float32)
    return np.clip(np.sqrt(rate * lag) * t, -SAFETY_BOUND, SAFETY_BOUND), trajectory


def drift_metrics(rng: np.random.Generator, ledgers: list, trained_version: int, rate: float,
                  truncation: float = 2.0) -> dict[str, float]:
    """The step's ``traj_offpolicy/*`` as the trainer would log them (token scope), ``traj_offpolicy/seq_ess``
    (trajectory-scope sequence weights, off-policy trajectories), and ``traj_offpolicy/effective_token_share`` (the
    truncated token weights' sum over the token count: what the update effectively sees of what it trains)."""
    out = lag_stats(ledgers, trained_version)
    if not ledgers:
        return out
    log_ratio, trajectory = token_log_ratios(rng, ledgers, trained_version, rate)
    ratio = torch.from_numpy(log_ratio)
    off_traj = np.array([any(v < trained_version for v, n in ledger if n > 0) for ledger in ledgers])
    off = torch.from_numpy(off_traj[trajectory])
    out.update(weight_health(ratio, off, truncation))
    out.update(weight_health(ratio, torch.ones_like(off), truncation, "_all"))
    sequence = np.bincount(trajectory, weights=log_ratio.astype(np.float64), minlength=len(ledgers))
    out.update({k.replace("traj_offpolicy/ess", "traj_offpolicy/seq_ess"): v for k, v in weight_health(
        torch.from_numpy(sequence), torch.from_numpy(off_traj), truncation).items() if k.endswith("/ess")})
    kept = np.minimum(np.exp(log_ratio.astype(np.float64)), truncation)
    out["traj_offpolicy/effective_token_share"] = float(kept.sum() / max(kept.size, 1))
    return out
