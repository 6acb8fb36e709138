"""Per-trajectory metrics of a v1 step, and the real rows of the step's batch for verl's own metrics.

verl's v1 metrics average rows: with step rows a long trajectory counts once per LLM call, and its timing and
throughput metrics count padding rows. This module gives the per-trajectory view (``traj_reward/*``,
``traj_version/*``, ``traj_stepwise/*``) and :class:`StepPadding`, the padding flag of every row planned since the
last step's metrics (the real-row mask of verl's timing and throughput metrics).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import ray
import torch
import transfer_queue as tq

from verl_traj.core.rollout.length_bias import LengthBudget, Lengths, bias_metrics
from verl_traj.core.rollout.offpolicy import lag_stats, sample_trajectory_rows, weight_health
from verl_traj.core.rollout.row_key import parse_row_keys
from verl_traj.core.rollout.row_tags import MERGE_TAG, turn_reward_entries
from verl_traj.core.rollout.session_ledger import LENGTH_TAG, TOOL_CALLS_TAG, VERSION_TOKENS_TAG
from verl_traj.core.rollout.staleness import token_staleness_metrics
from verl_traj.integration.config.access import int_at
from verl_traj.stepwise.prefix_merge import MergeStats

__all__ = ["RolloutBusy", "StepPadding", "last_rows_of_trajectories", "length_bias_metrics", "offpolicy_metrics",
           "length_budget", "stepwise_metrics",
           "tool_call_metrics", "trajectory_metrics"]

OFFPOLICY_READ_ROWS = 4096  # the most rows offpolicy_metrics reads a step (sample_trajectory_rows: why this many)


def stepwise_metrics(tags: list[dict]) -> dict[str, float]:
    """``traj_stepwise/*`` (as on v0) from the merge statistics the step-wise agent-loop worker tags each session
    with; nothing for a batch without step-wise sessions."""
    stats = [t[MERGE_TAG] for t in tags if MERGE_TAG in t]
    if not stats:
        return {}
    out = sum((MergeStats(**s) for s in stats), MergeStats()).metrics("traj_stepwise")
    out["traj_stepwise/trajectories"] = float(len(stats))
    turn = turn_reward_entries(tags)
    if turn is not None:  # what the agent loop gave as turn rewards this step (as on v0)
        out["traj_stepwise/turn_reward_sum"] = float(turn[2].sum())
        out["traj_stepwise/turn_rewards_nonzero"] = float((turn[2] != 0).sum())
    return out


def last_rows_of_trajectories(keys: list[str], is_padding: np.ndarray) -> np.ndarray:
    """Indices of each real trajectory's last row (its highest step) among ``keys`` (``{uid}_{session}_{index}``)."""
    parsed = parse_row_keys(keys)
    code = np.unique(parsed.traj_id.astype(str), return_inverse=True)[1]
    last_step = np.full(code.max() + 1 if code.size else 0, -1, dtype=np.int64)
    np.maximum.at(last_step, code[~is_padding], parsed.step[~is_padding])
    return np.flatnonzero(~is_padding & (parsed.step == last_step[code]))


def length_budget(config: Any) -> LengthBudget:
    """The hard length budget of a trajectory of verl's tool agent loop (and of verl_traj's step-wise loop: it plus
    recording), in :data:`~verl_traj.core.rollout.session_ledger.LENGTH_TAG`'s measures, from verl's config, read once:

    * turns (LLM calls) = ``actor_rollout_ref.rollout.multi_turn.max_assistant_turns``, where the loop stops; ``null``
      or 0 (verl: no limit) or absent: unknown;
    * generated tokens = turns x ``actor_rollout_ref.rollout.response_length``: each call can generate up to
      ``response_length`` (verl's ``LLMServerClient`` pins ``max_tokens`` to it where the loop passes none, and counts
      every resumed attempt of a call against it; vLLM's and verl_traj's CPU server default to at most it), and the
      ledger counts every call's tokens (the step-wise loop clips only what it records for training). The loop also
      stops once its response mask (generated plus tool tokens) reaches ``response_length``, which would bound a
      trajectory near twice that, but the mask is counted after verl's token merge (which may trim tokens at a
      turn's boundary), not what was generated: so the product, loose but rigorous. Unknown where the turns are.

    A loop of one's own may have other limits: a length over the budget raises it to that length
    (:func:`~verl_traj.core.rollout.length_bias.budget_mean`)."""
    turns = int_at(config, "actor_rollout_ref.rollout.multi_turn.max_assistant_turns", 0, minimum=0)
    response = int_at(config, "actor_rollout_ref.rollout.response_length", 0, minimum=0)
    return LengthBudget(tokens=float(turns * response) if turns and response else None,
                        turns=float(turns) if turns else None)


def length_bias_metrics(batch: Any, cut: dict[str, Lengths], budget: LengthBudget = LengthBudget()) -> dict[str, float]:
    """``traj_bias/*`` of a step (:func:`~verl_traj.core.rollout.length_bias.bias_metrics`): the trajectories it trains (each
    one's :data:`~verl_traj.core.rollout.session_ledger.LENGTH_TAG` on its last row) against those ``cut`` (by cause: what the
    replay buffer let go since the last step, :class:`~verl_traj.integration.async_modes.cut_lengths.CutLengths`);
    ``budget`` (:func:`length_budget`) gives the bracket its lower end."""
    pad = np.array([bool(t.get("is_padding", False)) for t in batch.tags], dtype=bool)
    lengths = [batch.tags[i][LENGTH_TAG] for i in last_rows_of_trajectories(batch.keys, pad)
               if LENGTH_TAG in batch.tags[i]]
    trained = Lengths.of([t for t, _ in lengths], [c for _, c in lengths])
    return bias_metrics(trained, cut, budget=budget) if len(trained) else {}


def _version_metrics(tags: list[dict], global_steps: int) -> dict[str, float]:
    """``traj_version/*`` from the last rows' ``min_global_steps`` / ``max_global_steps`` tags (none if missing) and
    their version tokens (``token_*``, :func:`~verl_traj.core.rollout.staleness.token_staleness_metrics`; none if missing)."""
    out = {}
    if all(VERSION_TOKENS_TAG in t for t in tags):
        out = token_staleness_metrics([t[VERSION_TOKENS_TAG] for t in tags], global_steps - 1)
    if not all(t.get("min_global_steps") is not None and t.get("max_global_steps") is not None for t in tags):
        return out
    lo = np.array([int(t["min_global_steps"]) for t in tags])
    hi = np.array([int(t["max_global_steps"]) for t in tags])
    stale = global_steps - 1 - lo
    return {**out, "traj_version/staleness_max": float(stale.max()), "traj_version/staleness_mean": float(stale.mean()),
            "traj_version/span_max": float((hi - lo + 1).max()),
            "traj_version/multi_version_share": float((hi > lo).mean())}


def offpolicy_metrics(batch: Any, global_steps: int, truncation: Optional[float]) -> dict[str, float]:
    """One read of the step's real rows' old and rollout log-probs, every step of an async mode. The weight sync's
    check: over the rows generated entirely by the policy whose old log-probs were just computed
    (``min_global_steps == max_global_steps == global_steps - 1``: the weights synced after the previous step), the
    largest gap between the rollout's and the actor's token probabilities (verl's ``training/rollout_probs_diff_max``
    restricted to them), ``traj_version/current_policy_probs_diff_max``: rounding level where the rollout runs the
    synced weights (CPU fp32: ~1e-8); an order of the policy's per-step change where it does not;
    ``traj_version/current_policy_rows``: how many were checked (nothing where none). And, with
    ``truncation`` (``traj.stale_groups=correct``: verl's ``rollout_is_threshold``), ``traj_offpolicy/*``: the
    token weights' health (:func:`~verl_traj.core.rollout.offpolicy.weight_health`) over the off-policy trajectories (a row
    with a token older than the trained policy makes its trajectory one) and over all (``*_all``), the lag of every
    trained token from the trajectories' version tokens (:func:`~verl_traj.core.rollout.offpolicy.lag_stats`), and the
    weight-weighted length ratio ``traj_bias/tokens_mean_ratio_weighted`` (what the truncated weights leave of each
    trajectory's tokens, against the plain mean: truncation can shorten what the update effectively sees).

    The read is bounded: past :data:`OFFPOLICY_READ_ROWS` rows to check (all real rows with ``truncation``, else the
    current policy's), it reads a sample of whole trajectories seeded by ``global_steps``
    (:func:`~verl_traj.core.rollout.offpolicy.sample_trajectory_rows`); ``traj_offpolicy/rows_read`` says how many rows. The
    lag and the count of off-policy trajectories come from the tags: every row."""
    tags, current = batch.tags, global_steps - 1
    real = np.flatnonzero([not t.get("is_padding", False) for t in tags])
    on_policy = np.array([tags[i].get("min_global_steps") == current == tags[i].get("max_global_steps") for i in real],
                         dtype=bool)
    checked = np.flatnonzero(on_policy if truncation is None else np.ones(real.size, dtype=bool))  # into real
    if not checked.size:
        return {}
    trajectory = np.unique(parse_row_keys([batch.keys[i] for i in real]).traj_id.astype(str), return_inverse=True)[1]
    read = checked[sample_trajectory_rows(trajectory[checked], OFFPOLICY_READ_ROWS, global_steps)]
    data = tq.kv_batch_get(keys=[batch.keys[i] for i in real[read]], partition_id=batch.partition_id,
                           select_fields=["old_log_probs", "rollout_log_probs", "response_mask"])
    padded = {k: (v.to_padded_tensor(0.0) if getattr(v, "is_nested", False) else v).float() for k, v in data.items()}
    on = torch.as_tensor(on_policy[read])
    out = {}
    if on.any():  # the gap [K, R] is not kept past its maximum
        gap = float(((padded["old_log_probs"].exp() - padded["rollout_log_probs"].exp()).abs()
                     * padded["response_mask"])[on].max())
        out = {"traj_version/current_policy_probs_diff_max": gap, "traj_version/current_policy_rows": float(on.sum())}
    if truncation is None:
        return out
    return {**out, **_weight_metrics(batch, real, trajectory, read, padded, truncation, current)}


def _weight_metrics(batch: Any, real: np.ndarray, trajectory: np.ndarray, read: np.ndarray, padded: dict,
                    truncation: float, current: int) -> dict[str, float]:
    """``traj_offpolicy/*`` and the weighted length ratio of :func:`offpolicy_metrics`: ``real`` ``[B]`` the real
    rows, ``trajectory`` ``[B]`` their trajectories (dense codes), ``read`` ``[K]`` the positions in ``real`` of the
    rows read (whole trajectories), ``padded`` their fields ``[K, R]``."""
    log_ratio, mask = padded["old_log_probs"] - padded["rollout_log_probs"], padded["response_mask"].bool()
    stale_row = np.array([int(batch.tags[i].get("min_global_steps", current)) < current for i in real], dtype=bool)
    stale_traj = np.zeros(trajectory.max() + 1, bool)
    np.logical_or.at(stale_traj, trajectory, stale_row)
    off = torch.as_tensor(stale_traj[trajectory[read]])[:, None] & mask
    out = {**weight_health(log_ratio, off, truncation), **weight_health(log_ratio, mask, truncation, "_all"),
           "traj_offpolicy/trajectories": float(stale_traj.sum()), "traj_offpolicy/rows_read": float(read.size),
           "traj_offpolicy/token_share": float(off.sum()) / max(float(mask.sum()), 1.0)}
    ledgers = [batch.tags[i][VERSION_TOKENS_TAG] for i in real if VERSION_TOKENS_TAG in batch.tags[i]]
    out.update(lag_stats(ledgers, current))
    weight = log_ratio.to(torch.float64, copy=True).exp_().clamp_(max=truncation).mul_(mask)  # truncated weights
    per_traj = torch.zeros(stale_traj.size, dtype=torch.float64)
    tokens = torch.zeros_like(per_traj)
    index = torch.as_tensor(trajectory[read])
    per_traj.index_add_(0, index, weight.sum(-1))
    tokens.index_add_(0, index, mask.sum(-1).double())
    has = tokens > 0  # the trajectories read (with a loss token)
    if has.any():  # each trajectory weighted by its mean truncated weight, against the plain mean length
        omega, length = per_traj[has] / tokens[has], tokens[has]
        if float(omega.sum()) > 0:
            weighted = float((omega * length).sum() / omega.sum())
            out["traj_bias/tokens_mean_ratio_weighted"] = weighted / float(length.mean())
    return out


def tool_call_metrics(tags: list[dict]) -> dict[str, float]:
    """``traj_agent/*`` from the last rows' :data:`TOOL_CALLS_TAG` (``[parsed, malformed]``; none if no trajectory
    has it): ``tool_calls_mean`` (per trajectory, both kinds) and ``malformed_tool_call_share`` (of the tool calls the
    model wrote, those the parser could not decode)."""
    counts = np.array([t.get(TOOL_CALLS_TAG, (0, 0)) for t in tags], dtype=np.float64).reshape(-1, 2)
    if not any(TOOL_CALLS_TAG in t for t in tags):
        return {}
    written = counts.sum()
    return {"traj_agent/tool_calls_mean": float(written / len(tags)),
            "traj_agent/malformed_tool_call_share": float(counts[:, 1].sum() / written) if written else 0.0}


def trajectory_metrics(batch: Any, global_steps: int) -> dict[str, float]:
    """Per trajectory, whatever its row count, read from each trajectory's last row (stock runs too):

    * ``traj_reward/*``: the outcome score (the last row's ``rm_scores``), mean / min / max over trajectories;
    * ``traj_version/*``: the policy versions it was generated under (the rows' ``min_global_steps`` /
      ``max_global_steps`` tags, which verl's staleness control reads), per trajectory (verl's
      ``training/off_policy/*`` are per row): ``staleness_max`` / ``_mean`` = versions behind the trained policy at
      its first token (verl's worst-case staleness, ``global_steps - 1 - min_global_steps``), ``span_max`` = versions
      it spans, ``multi_version_share`` = share generated across more than one (partial rollouts); in tokens
      (``traj.enable``): ``token_staleness_mean`` / ``_max`` and ``current_policy_token_share``, what
      ``traj.max_staleness`` bounds (:mod:`verl_traj.core.rollout.staleness`);
    * ``traj_agent/*``: the tool calls the model wrote, and the share it wrote malformed (:func:`tool_call_metrics`)."""
    pad = np.array([bool(t.get("is_padding", False)) for t in batch.tags], dtype=bool)
    last = last_rows_of_trajectories(batch.keys, pad)
    if last.size == 0:
        return {}
    scores = tq.kv_batch_get(keys=[batch.keys[i] for i in last], partition_id=batch.partition_id,
                             select_fields=["rm_scores"])["rm_scores"]
    score = (scores.to_padded_tensor(0.0) if scores.is_nested else scores).sum(-1).float()
    out = {"traj_reward/mean": float(score.mean()), "traj_reward/min": float(score.min()),
           "traj_reward/max": float(score.max()), "traj_reward/trajectories": float(last.size)}
    out.update(_version_metrics([batch.tags[i] for i in last], global_steps))
    out.update(tool_call_metrics([batch.tags[i] for i in last]))
    return out


@dataclass
class StepPadding:
    """The padding flag of every row planned since the last step's metrics, by key. One global step may run several
    local updates (``parameter_sync_step > 1``), each planned; the step's batch holds all their rows."""

    by_key: dict[str, bool] = field(default_factory=dict)

    def record(self, keys: list[str], is_padding: list[bool]) -> None:
        """Remember one planned batch's rows."""
        self.by_key.update(zip(keys, is_padding))

    def real_rows(self, keys: list[str]) -> np.ndarray:
        """``[B]`` bool: the real rows of a step's batch (then forgets every recorded row). Raises when a key was
        not planned (something replaced rows after planning)."""
        missing = [k for k in keys if k not in self.by_key]
        if missing:
            raise RuntimeError(f"{len(missing)} rows of the step's batch (first: {missing[0]!r}) were not planned by "
                               "_balance_batch: something replaced rows after planning. verl_traj needs the planned "
                               "rows.")
        real = ~np.array([self.by_key[k] for k in keys], dtype=bool)
        self.by_key = {}
        return real


@dataclass
class RolloutBusy:
    """``rollout_pool/<pool>_busy_share``: the share of the wall time since the previous step that each rollout pool's
    servers spent generating (mean over its servers), from servers that report their generation seconds
    (``get_stats``: the CPU rollout server; vLLM's and SGLang's do not, and are skipped). Pools: ``hybrid`` (the
    trainer's colocated replicas), ``standalone`` (``separate_async``'s rollout pool). What asynchrony buys shows here
    and in verl's ``timing_s/gen`` (the trainer waiting for rollouts)."""

    last: dict[tuple[str, int], tuple[float, float]] = field(default_factory=dict)  # (pool, server) -> (wall, gen s)

    def metrics(self, pools: dict[str, list]) -> dict[str, float]:
        out = {}
        for pool, handles in pools.items():
            handles = [h for h in handles if hasattr(h, "get_stats")]
            if not handles:
                continue
            stats, now = ray.get([h.get_stats.remote() for h in handles]), time.perf_counter()
            shares = []
            for key, stat in zip(((pool, i) for i in range(len(handles))), stats):
                if key in self.last and now > self.last[key][0]:
                    shares.append((stat["gen_seconds"] - self.last[key][1]) / (now - self.last[key][0]))
                self.last[key] = (now, float(stat["gen_seconds"]))
            if shares:
                out[f"rollout_pool/{pool}_busy_share"] = float(np.mean(shares))
        return out
