#!/usr/bin/env python
"""Benchmark: verl_traj's plan vs verl 0.9.1's v1 trainer (``trainer.use_v1=true``) on multi-turn agent batches.

v1 stores every agent-loop output of a session as its own row (``{uid}_{session}_{index}``), so a batch holds
``prompts x n`` sessions of 1..T rows. Its ``_balance_batch`` (``verl/trainer/ppo/v1/trainer_base.py``), replicated
here with verl's own functions: pad the batch with 128-token rows to a multiple of ``lcm(dp, ppo_mini_batch_size x
n)`` (``upsample_batch_to_divisible_size``), Karmarkar-Karp over the whole batch into dp equal-size rank shards
(``get_seqlen_balanced_partitions(calculate_workload(seq_len), dp, equal_size=True)``), and each rank's shard cut
into fixed slices of ``ppo_mini_batch_size x n / dp`` rows (``TrainingWorker.train_mini_batch``): the number of
optimizer steps is rows / (mini-batch rows), so it grows with the number of turns, and sessions and groups fall
into several mini-batches.

Ours: ``build_layout_from_counts`` on the keys' (group, session, step) and the rows' tokens, then
``plan_mini_batches`` with ``M = prompts / ppo_mini_batch_size`` and 2-token padding rows (what the v1 adapter runs).

Sessions are drawn (seeded, with replacement) from the 500 real SWE-bench trajectories in ``shared/data``: each
LLM call one row, as a v1 agent loop returning one output per call stores them.

    python scripts/bench_v1.py            # table
    python scripts/bench_v1.py --json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np

from verl_traj.core import build_layout_from_counts, count_splits, plan_mini_batches
from verl_traj.testing.swebench import load_trajectories

V1_PAD_TOKENS = 128  # verl.trainer.ppo.padding_utils.SYNTHETIC_PADDING_SEQ_LEN
# (prompts, rollout.n, ppo_mini_batch_size, dp)
SCENARIOS = [(16, 8, 4, 8), (32, 8, 8, 8), (64, 16, 32, 8), (32, 4, 8, 16)]


def sessions(prompts: int, n: int, seed: int) -> dict:
    """Rows of ``prompts x n`` sessions drawn from the SWE-bench trajectories (one row per LLM call)."""
    trajs = load_trajectories()
    pick = np.random.default_rng(seed).integers(0, len(trajs), size=prompts * n)
    steps = [np.asarray(trajs[i]["steps"], dtype=np.int64).reshape(-1, 2) for i in pick]
    count = np.array([len(s) for s in steps])
    session = np.repeat(np.arange(prompts * n), count)
    return dict(uid=np.asarray([f"p{s // n}" for s in session], dtype=object),
                traj=np.asarray([f"p{s // n}_{s % n}" for s in session], dtype=object),
                step=np.concatenate([np.arange(c) for c in count]), tokens=np.concatenate(steps).sum(1),
                loss=np.concatenate(steps)[:, 1])


def _balance_ratio(tokens: np.ndarray, mb: np.ndarray, rank: np.ndarray, dp: int) -> float:
    """Worst mini-batch: slowest rank's verl workload over its lower bound."""
    from verl.utils.seqlen_balancing import calculate_workload

    w = calculate_workload(__import__("torch").as_tensor(tokens)).numpy().astype(np.float64)
    worst = 1.0
    for m in np.unique(mb):
        per_rank = np.bincount(rank[mb == m], weights=w[mb == m], minlength=dp)
        bound = max(per_rank.sum() / dp, w[mb == m].max())
        worst = max(worst, per_rank.max() / bound)
    return worst


def stock_v1(rows: dict, prompts: int, n: int, mini: int, dp: int) -> dict:
    import torch
    from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions

    t0 = time.perf_counter()
    real = len(rows["tokens"])
    per_mb = mini * n
    pad = (-real) % math.lcm(dp, per_mb)
    tokens = np.concatenate([rows["tokens"], np.full(pad, V1_PAD_TOKENS)])
    parts = get_seqlen_balanced_partitions(calculate_workload(torch.as_tensor(tokens)), k_partitions=dp,
                                           equal_size=True)
    order = np.concatenate([np.asarray(p) for p in parts])
    seconds = time.perf_counter() - t0
    shard = len(order) // dp
    mb_of = np.empty(len(order), dtype=np.int64)
    rank_of = np.empty(len(order), dtype=np.int64)
    mb_of[order] = (np.arange(len(order)) % shard) // (per_mb // dp)
    rank_of[order] = np.arange(len(order)) // shard
    layout = build_layout_from_counts(rows["tokens"], rows["loss"], rows["uid"], traj_id=rows["traj"],
                                      step_index=rows["step"])
    split_t, split_g = count_splits(layout.traj_index.numpy(), layout.group_index.numpy(), mb_of[:real])
    return dict(rows=len(order), padding_rows=pad, padding_tokens=pad * V1_PAD_TOKENS,
                optimizer_steps=len(order) // per_mb, split_trajectories=split_t, split_groups=split_g,
                balance_worst=_balance_ratio(tokens, mb_of, rank_of, dp), seconds=seconds)


def ours(rows: dict, prompts: int, n: int, mini: int, dp: int) -> dict:
    t0 = time.perf_counter()
    layout = build_layout_from_counts(rows["tokens"], rows["loss"], rows["uid"], traj_id=rows["traj"],
                                      step_index=rows["step"])
    plan = plan_mini_batches(layout, prompts // mini, dp)
    seconds = time.perf_counter() - t0
    src = plan.order.clamp(min=0).numpy()
    tokens = np.where(plan.is_padding.numpy(), 2, rows["tokens"][src])
    rank = np.arange(plan.num_rows) // (plan.num_rows // dp)  # rank-major: rank r holds the r-th block
    return dict(rows=plan.num_rows, padding_rows=int(plan.is_padding.sum()), padding_tokens=int(plan.stats.padding_tokens.sum()),
                optimizer_steps=plan.num_mini_batches, split_trajectories=plan.split_trajectories,
                split_groups=plan.split_groups, balance_worst=_balance_ratio(tokens, plan.mini_batch_id.numpy(), rank, dp),
                seconds=seconds)


def run(seed: int) -> list[dict]:
    out = []
    for prompts, n, mini, dp in SCENARIOS:
        rows = sessions(prompts, n, seed)
        name = f"{prompts} prompts x {n}, mini-batch {mini} prompts, dp={dp}"
        for method, fn in (("verl 0.9.1 v1", stock_v1), ("verl_traj", ours)):
            out.append(dict(scenario=name, method=method, real_rows=len(rows["tokens"]),
                            configured_steps=prompts // mini, **fn(rows, prompts, n, mini, dp)))
    return out


def table(results: list[dict]) -> str:
    head = ("| scenario | method | real rows | + padding rows (tokens) | optimizer steps (configured) | split sessions "
            "| split groups | slowest rank / lower bound, worst mini-batch | plan time (s) |")
    lines = [head, "|" + "---|" * 9]
    for r in results:
        lines.append(
            f"| {r['scenario']} | {r['method']} | {r['real_rows']:,} | {r['padding_rows']:,} ({r['padding_tokens']:,}) "
            f"| {r['optimizer_steps']} ({r['configured_steps']}) | {r['split_trajectories']:,} | {r['split_groups']:,} "
            f"| {r['balance_worst']:.4f} | {r['seconds']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = run(args.seed)
    print(json.dumps(results, indent=1, default=float) if args.json else table(results))


if __name__ == "__main__":
    main()
