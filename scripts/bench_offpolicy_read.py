#!/usr/bin/env python
"""Benchmark: the driver's per-step off-policy read (``offpolicy_metrics``, ``traj.stale_groups=correct``), before
(every real row's ``old_log_probs``, ``rollout_log_probs``, ``response_mask``) and now (at most
``OFFPOLICY_READ_ROWS`` rows, a seeded sample of whole trajectories).

Synthetic padded tensors stand in for TransferQueue: rows of ``--length`` tokens (masks of 64 to ``--length``), half
the trajectories off-policy at lags 1-4 (log-ratio N(0, 0.01 lag) per token plus a per-trajectory drift N(0,
(0.05 lag)^2)), ``rollout_is_threshold`` 2. ``MB``: what the read carries at verl's dtypes (fp32, fp32, int64,
padded); ``s``: the metrics call (the transfer itself not included). ``dM2`` / ``dESS``: the sample's error on the
gate's statistics (``log_ratio_m2`` relative, ``ess_truncated`` absolute), mean / max over 8 steps' samples.

    python scripts/bench_offpolicy_read.py [--rows 1000,10000,100000] [--length 512] [--rows-per-trajectory 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from types import SimpleNamespace

import numpy as np
import torch
from transfer_queue import KVBatchMeta

from verl_traj.integration.trainers import v1_metrics

BYTES_PER_TOKEN, STEPS = 4 + 4 + 8, 8  # old, rollout (fp32), response_mask (int64); steps (seeds) sampled
M2, ESS = "traj_offpolicy/log_ratio_m2", "traj_offpolicy/ess_truncated"
COLUMNS = {"rows": "{:>7}", "read before": "{:>11}", "read now": "{:>8}", "MB before": "{:>9.1f}",
           "MB now": "{:>6.1f}", "s before": "{:>8.2f}", "s now": "{:>5.2f}", "dM2 mean": "{:>8.1%}",
           "dM2 max": "{:>7.1%}", "dESS mean": "{:>9.4f}", "dESS max": "{:>8.4f}"}


def synthetic(rows: int, length: int, per_traj: int, seed: int = 0):
    rng, _ = np.random.default_rng(seed), torch.manual_seed(seed)
    traj = np.arange(rows) // per_traj
    lag = np.where(rng.random(traj.max() + 1) < 0.5, rng.integers(1, 5, traj.max() + 1), 0)[traj]
    keys = [f"g{t // 8}_{t % 8}_{i % per_traj}" for i, t in enumerate(traj)]
    scale = torch.from_numpy(np.sqrt(0.01 * lag)).float()[:, None]
    drift = torch.from_numpy(0.05 * lag * rng.standard_normal(traj.max() + 1)[traj]).float()[:, None]
    rollout = -torch.rand(rows, length)
    old = torch.randn(rows, length).mul_(scale).add_(drift).add_(rollout)
    mask = torch.arange(length)[None, :] < torch.from_numpy(rng.integers(64, length + 1, rows))[:, None]
    return keys, lag, {"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask}


def run(keys, lag, fields, budget: int, step: int):
    """The metrics call at ``step`` (the sample's seed) with ``budget``: (metrics, rows read, seconds)."""
    tags = [{"min_global_steps": step - 1 - int(g), "max_global_steps": step - 1} for g in lag]
    position, read = {k: i for i, k in enumerate(keys)}, []

    def kv_batch_get(keys, partition_id, select_fields):
        read.append(len(keys))
        if len(keys) == len(position):  # every row, in order: the stored tensors, no copy
            return {f: fields[f] for f in select_fields}
        index = torch.tensor([position[k] for k in keys])
        return {f: fields[f].index_select(0, index) for f in select_fields}

    v1_metrics.tq, v1_metrics.OFFPOLICY_READ_ROWS = SimpleNamespace(kv_batch_get=kv_batch_get), budget
    start = time.perf_counter()
    out = v1_metrics.offpolicy_metrics(KVBatchMeta(keys=keys, tags=tags, partition_id="train"), step, 2.0)
    return out, read[0], time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1000,10000,100000")
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--rows-per-trajectory", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as one driver thread; on a shared machine more threads mostly spin-wait
    budget, table, mb = v1_metrics.OFFPOLICY_READ_ROWS, [], args.length * BYTES_PER_TOKEN / 2**20
    run(*synthetic(64, args.length, args.rows_per_trajectory), 64, 10)  # warm-up: first calls pay torch's set-up
    for rows in (int(float(r)) for r in args.rows.split(",")):
        keys, lag, fields = synthetic(rows, args.length, args.rows_per_trajectory)
        full, n_all, s_all = run(keys, lag, fields, rows, 10)
        now = [run(keys, lag, fields, budget, step) for step in range(10, 10 + (STEPS if rows > budget else 1))]
        d_m2 = [abs(out[M2] / full[M2] - 1) for out, _, _ in now]
        d_ess = [abs(out[ESS] - full[ESS]) for out, _, _ in now]
        table.append({"rows": rows, "read_before": n_all, "read_now": now[0][1], "mb_before": n_all * mb,
                      "mb_now": now[0][1] * mb, "s_before": s_all, "s_now": float(np.mean([s for _, _, s in now])),
                      "dm2_mean": float(np.mean(d_m2)), "dm2_max": max(d_m2), "dess_mean": float(np.mean(d_ess)),
                      "dess_max": max(d_ess), "m2": full[M2], "ess_truncated": full[ESS]})
        del keys, lag, fields, full, now
    head = {"budget": budget, "length": args.length, "rows_per_trajectory": args.rows_per_trajectory,
            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}
    if args.json:
        return print(json.dumps({**head, "table": table}, indent=1))
    print(", ".join(f"{k} {v}" for k, v in head.items()))
    print(" ".join(f"{name:>{len(fmt.format(0))}}" for name, fmt in COLUMNS.items()))
    for r in table:
        print(" ".join(fmt.format(r[key]) for key, fmt in zip(table[0], COLUMNS.values())))


if __name__ == "__main__":
    main()
