#!/usr/bin/env python
"""Driver-side cost per training step: verl_traj's planner, apply and trainer hooks vs stock verl, one process.

A GRPO batch of ``--rows`` rows (``--n`` per group, left-padded prompts of ``--prompt-len``, right-padded
responses of ``--response-len``: every [B, L] tensor verl's ``fit`` holds) goes through what runs on the
driver between rollout and update:

* ``_balance_batch``: stock = verl's own method (Karmarkar-Karp over DP ranks, ``batch.reorder``);
  verl_traj = ``TrajRayPPOTrainer._balance_batch`` (layout -> plan -> ``apply_plan``: rows reordered
  rank-major, padding rows appended, the plan's per-row facts attached), timed as plan (core) + apply;
* ``compute_advantage`` (GRPO): stock = verl's function on all rows; verl_traj = the real-rows wrapper;
* loss weights (verl_traj only: once per update call, actor and critic);
* the end-of-step metrics (data, timing, throughput): stock = on all rows; verl_traj = real rows, one shared copy.

    python scripts/bench_driver.py [--rows 20000] [--dp 8] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import torch
from omegaconf import OmegaConf


def make_batch(args):
    from verl_traj.testing import as_dataproto, rl_batch

    return as_dataproto(*rl_batch(_groups(args), args.n, prompt_len=args.prompt_len,
                                  response_len=args.response_len, seed=args.seed))


def _groups(args) -> int:
    """Groups of ``n`` rows, as many as fit in ``--rows`` with a row count divisible by dp (stock verl needs it)."""
    g = args.rows // args.n
    while (g * args.n) % args.dp or g % args.mini_batches:
        g -= 1
    return g


def _stock_trainer(dp: int):
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    tr = RayPPOTrainer.__new__(RayPPOTrainer)
    tr._get_dp_size = lambda wg, role: dp
    tr.actor_rollout_wg = None
    tr.config = OmegaConf.create({"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 1}}})
    return tr


def _traj_trainer(args):
    from verl_traj.integration.verl_config import PlanSettings
    from verl_traj.testing.trainers import ray_less_trainer

    return ray_less_trainer({"data": {"train_batch_size": _groups(args)},
                             "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": _groups(args) // args.mini_batches,
                                                             "ppo_epochs": 1}}},
                            {}, plan=PlanSettings(args.cap, "tokens", True), dp=args.dp)


def _timed(fn, *a, **k):
    gc.collect()
    t0 = time.perf_counter()
    out = fn(*a, **k)
    return time.perf_counter() - t0, out


def _step(args, variant: str) -> dict:
    from verl.trainer.ppo import ray_trainer as rt
    from verl.trainer.ppo.core_algos import AdvantageEstimator

    from verl_traj.core import compute_loss_weights
    from verl_traj.integration.patches import fit_patches, patched

    batch, metrics, out = make_batch(args), {}, {}
    adv_kw = dict(adv_estimator=AdvantageEstimator.GRPO, num_repeat=args.n, config=OmegaConf.create({}))
    if variant == "stock":
        out["balance_batch_s"], _ = _timed(rt.RayPPOTrainer._balance_batch, _stock_trainer(args.dp), batch, metrics)
        out["advantage_s"], _ = _timed(rt.compute_advantage, batch, **adv_kw)
        out["metrics_s"], _ = _timed(_metrics, rt, batch)
        return out
    tr = _traj_trainer(args)
    out["balance_batch_s"], plan = _timed(tr.plan_and_apply, batch, args.dp, metrics)
    out["plan_s"] = sum(plan.timing_s.values())
    out["padding_rows"] = int(plan.stats.padding_rows.sum())
    with patched(fit_patches(False)):
        out["advantage_s"], _ = _timed(rt.compute_advantage, batch, **adv_kw)
        td = batch.batch
        out["loss_weights_s"], _ = _timed(compute_loss_weights, "token-mean", td["response_mask"], td["mini_batch_id"],
                                          td["traj_index"], td["is_padding"])
        out["metrics_s"], _ = _timed(_metrics, rt, batch)
    return out


def _metrics(rt, batch) -> None:
    rt.compute_data_metrics(batch=batch, use_critic=False)
    rt.compute_timing_metrics(batch=batch, timing_raw={"step": 1.0, "gen": 0.5})
    rt.compute_throughout_metrics(batch=batch, timing_raw={"step": 1.0}, n_gpus=8)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--n", type=int, default=5, help="rows per GRPO group")
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--mini-batches", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--response-len", type=int, default=1536)
    ap.add_argument("--cap", type=int, default=32_768, help="update micro-batch cap (tokens per rank)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    runs = {v: [_step(args, v) for _ in range(args.repeats)] for v in ("stock", "traj")}
    res = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in runs.items()}
    for v in res.values():
        v["total_s"] = sum(x for k, x in v.items() if k.endswith("_s") and k != "plan_s")
    report = {"config": vars(args), "results": res}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"driver cost per step: {_groups(args) * args.n} rows ({args.prompt_len}+{args.response_len} tokens wide), dp={args.dp}, "
          f"{args.mini_batches} mini-batches, median of {args.repeats}")
    print("| variant | _balance_batch (s) | of which plan (s) | advantages (s) | loss weights (s) | metrics (s) | total (s) | padding rows |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in res.items():
        print(f"| {name} | {r['balance_batch_s']:.3f} | {r.get('plan_s', float('nan')):.3f} | {r['advantage_s']:.3f} | "
              f"{r.get('loss_weights_s', 0.0):.3f} | {r['metrics_s']:.3f} | {r['total_s']:.3f} | {r.get('padding_rows', 0)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
