#!/usr/bin/env python
"""Driver-side cost per training step at the users' size: verl_traj's v0 driver path vs stock verl, one process.

The workload (``scripts/driver_workload.py``): ``--prompts`` x ``--n`` agent trajectories of at most ``--max-turns``
LLM calls, per-call lengths from the SWE-bench agent runs in ``shared/data/swebench_steps.jsonl`` scaled by
``--token-scale``, rows capped at ``--prompt-len + --response-len`` tokens (verl's ``max_prompt_length`` +
``response_length``: the agent loop stops a trajectory where its context reaches the cap). It arrives as verl's
agent loop leaves it: one row per trajectory, each LLM call recorded (delta-encoded) in ``traj_steps``.

Variants (``scripts/driver_phases.py``), each on the rows it trains:

* ``stock trajectory rows``: verl on the rollout rows (one per trajectory; what stock v0 trains; the same rows as
  verl_traj's prefix-merged ones when every context extends the previous call's, as here);
* ``stock step rows``: verl on one row per LLM call (what a multi-output agent loop gives stock verl);
* ``traj merged rows`` / ``traj step rows``: ``traj.step_wise=true`` with / without ``traj.merge_prefix``, GRPO or
  GiGPO (``algorithm.adv_estimator=gigpo``), optionally ``traj.prefix_tree`` (``+tree``).

``--planner-rows N`` also times the layout and the plan alone on N step rows (from counts: no [B, L] tensors).

    python scripts/bench_driver.py [--prompts 1024 --n 16 --max-turns 50] [--small] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver_phases as phases  # noqa: E402
import driver_workload as workload  # noqa: E402

VARIANTS = {
    "stock-merged": phases.Variant("stock", "merged"), "traj-merged": phases.Variant("traj", "merged"),
    "traj-merged-gigpo": phases.Variant("traj", "merged", "gigpo"),
    "traj-merged-tree": phases.Variant("traj", "merged", tree=True),
    "stock-step": phases.Variant("stock", "step"), "traj-step": phases.Variant("traj", "step"),
    "traj-step-gigpo": phases.Variant("traj", "step", "gigpo"), "traj-step-tree": phases.Variant("traj", "step", tree=True),
}
TRAJ_PHASES = ("expand", "layout", "plan", "apply", "tree_facts")  # TrajRayPPOTrainer._balance_batch
COLUMNS = ("expand", "layout", "plan", "apply", "tree_facts", "advantage", "loss_weights", "metrics")
SMALL = dict(prompts=16, n=4, max_turns=10, dp=4, mini_batches=4, planner_rows=2_000)


def _one(args, tensors, non_tensors, v: phases.Variant) -> phases.Meter:
    meter = phases.Meter()
    if v.driver == "stock":
        batch = (phases.step_rows(tensors, non_tensors, False, False) if v.rows == "step"
                 else phases._as_dataproto(tensors, {"uid": non_tensors["uid"]}))
        phases.stock_run(batch, args, meter)
    else:
        phases.traj_run(tensors, non_tensors, args, v, meter)
    return meter


def run_variant(args, tensors, non_tensors, key: str) -> dict:
    """Median seconds per phase over ``--repeats``, the largest peak RSS growth of any phase, and the facts."""
    from unittest import mock

    from verl_traj.integration.trainers import step_plan

    v = VARIANTS[key]
    cut = None if args.no_verl_cut else step_plan.verl_partitioner
    with mock.patch.object(step_plan, "verl_partitioner", cut):
        meters = [_one(args, tensors, non_tensors, v) for _ in range(args.repeats)]
    seconds = {k: statistics.median(m.seconds[k] for m in meters) for k in meters[0].seconds}
    balance = seconds.get("balance", sum(seconds.get(k, 0.0) for k in TRAJ_PHASES))
    out = {"variant": v.name, "seconds": seconds, "balance_batch_s": balance,
           "total_s": sum(seconds.values()), "peak_phase_mib": max(max(m.peak_bytes.values()) for m in meters) / 2**20,
           "peak_phase": max(meters[-1].peak_bytes, key=meters[-1].peak_bytes.get), **meters[-1].facts}
    pm = out.pop("plan_metrics", None)
    if pm:
        out["micro_batches"] = pm.get("traj_plan/micro_batches")
        out["micro_batches_lower_bound"] = pm.get("traj_plan/micro_batches_lower_bound")
        out["padding_rows"] = pm.get("traj_plan/padding_rows")
    return out


def _count_layout(args, rows: int):
    """The layout of about ``rows`` unmerged step rows of the workload, from counts (string ids, as production's)."""
    from verl_traj.core import build_layout_from_counts

    per_prompt = max(1.0, float(args.step_rows) / args.prompts)
    w = workload.Workload(int(np.ceil(rows / per_prompt)), args.n, args.max_turns, args.prompt_len,
                          args.response_len, args.token_scale, args.seed + 7)
    tr = workload.draw(w)
    context = np.cumsum(tr.obs + tr.resp) - tr.resp
    context -= np.repeat(context[tr.start] - tr.obs[tr.start], tr.calls)  # each call's prompt length
    traj = np.repeat(np.arange(tr.calls.size), tr.calls)
    step = np.arange(traj.size) - np.repeat(tr.start, tr.calls)
    uid = np.asarray([f"prompt-{g}" for g in tr.group], dtype=object)[traj]
    traj_id = np.asarray([f"traj-{b:07d}" for b in range(tr.calls.size)], dtype=object)[traj]
    last = step == np.repeat(tr.calls - 1, tr.calls)
    t0 = time.perf_counter()
    layout = build_layout_from_counts(context + tr.resp, tr.resp, uid, traj_id, step, last)
    return layout, time.perf_counter() - t0


def planner_at(args, rows: int, with_verl_cut: bool) -> dict:
    """Layout and plan of ``rows`` step rows (from counts: no [B, L] tensors) with the production settings;
    ``with_verl_cut=False``: the micro-batch packing without verl's Karmarkar-Karp candidate
    (``step_plan.verl_partitioner``), to show what the rest of the planner costs."""
    from unittest import mock

    from verl_traj.integration.trainers import step_plan

    layout, layout_s = _count_layout(args, rows)
    spec = phases.traj_trainer(args, VARIANTS["traj-step"]).spec
    with mock.patch.object(step_plan, "verl_partitioner", step_plan.verl_partitioner if with_verl_cut else None):
        t0 = time.perf_counter()
        plan = step_plan.plan_layout(layout, spec.traj_config, args.mini_batches, args.dp, micro=spec.plan, seed=0)
        plan_s = time.perf_counter() - t0
    m = plan.metrics("p")
    return {"rows": layout.num_rows, "verl_cut": with_verl_cut, "layout_s": layout_s, "plan_s": plan_s,
            "plan_internal_s": {k: round(x, 3) for k, x in plan.timing_s.items()},
            "micro_batches": m["p/micro_batches"], "micro_batches_lower_bound": m["p/micro_batches_lower_bound"]}


def planner_scaling(args) -> list:
    """The planner at 10^4 rows up to ``--planner-rows`` (x10 a step); with verl's cut only while the last such run
    took under ``--planner-budget`` seconds (it grows as rows x micro-batches a block)."""
    out, sizes, budget_ok = [], [], True
    n = 10_000
    while n < args.planner_rows:
        sizes.append(n)
        n *= 10
    for rows in sizes + [args.planner_rows]:
        out.append(planner_at(args, rows, False))
        if budget_ok:
            out.append(planner_at(args, rows, True))
            budget_ok = out[-1]["plan_s"] * 10 * 10 < args.planner_budget  # next size: 10x rows, 10x micro-batches
    return out


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default, text in (
            ("--prompts", 1024, "GRPO groups (data.train_batch_size)"), ("--n", 16, "samples a prompt (rollout.n)"),
            ("--max-turns", 50, "LLM calls a trajectory at most"), ("--prompt-len", 512, "data.max_prompt_length"),
            ("--response-len", 512, "rollout.response_length (the whole multi-turn response)"),
            ("--dp", 8, "data-parallel ranks"), ("--mini-batches", 16, "mini-batches a step"),
            ("--cap", 8192, "micro-batch token cap a rank (ppo_max_token_len_per_gpu)"),
            ("--repeats", 1, "runs of each variant (median)"), ("--seed", 0, "workload seed"),
            ("--planner-rows", 1_000_000, "also plan up to this many step rows from counts (0: skip)"),
            ("--planner-budget", 120, "seconds a planner run with verl's cut may be expected to take")):
        ap.add_argument(flag, type=int, default=default, help=text)
    ap.add_argument("--token-scale", type=float, default=0.25, help="factor on the recorded token counts")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    ap.add_argument("--no-verl-cut", action="store_true",
                    help="plan micro-batches without verl's Karmarkar-Karp candidate (what the packing costs without it)")
    ap.add_argument("--small", action="store_true", help=f"a quick check: {SMALL}")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.small:
        for k, x in SMALL.items():
            setattr(args, k, x)
    return args


def _vs_stock(results: list) -> None:
    stock = {r["variant"].split()[1]: r["total_s"] for r in results if r["variant"].startswith("stock")}
    for r in results:
        rows = "step" if " step " in r["variant"] else "trajectory"
        r["vs_stock"] = r["total_s"] / stock[rows] if rows in stock and not r["variant"].startswith("stock") else None


def print_table(report: dict) -> None:
    print(report["workload"])
    print(f"{report['trajectories']} trajectories, {report['step_rows']} LLM calls (step rows), calls a trajectory: "
          f"mean {report['calls_mean']:.1f}, max {report['calls_max']}; dp={report['config']['dp']}, "
          f"{report['config']['mini_batches']} mini-batches, cap {report['config']['cap']} tokens; "
          f"median of {report['config']['repeats']}; build {report['build_s']:.1f} s"
          + ("; micro-batches packed WITHOUT verl's Karmarkar-Karp candidate" if report["config"]["no_verl_cut"] else ""))
    cols = " | ".join(c.replace("_", " ") for c in COLUMNS)
    print(f"| variant | rows | width | _balance_batch (s) | {cols} | total (s) | vs stock | peak phase RSS (MiB) | "
          "micro-batches (lower bound) |")
    print("|---|---:|---:|---:|" + "---:|" * len(COLUMNS) + "---:|---:|---:|---|")
    for r in report["results"]:
        s = r["seconds"]
        cells = " | ".join(f"{s[c]:.3f}" if c in s else "" for c in COLUMNS)
        vs = f"{r['vs_stock']:.2f}x" if r.get("vs_stock") else ""
        micro = f"{r['micro_batches']:.0f} ({r['micro_batches_lower_bound']:.0f})" if r.get("micro_batches") else ""
        print(f"| {r['variant']} | {r['rows']} | {r.get('width', '')} | {r['balance_batch_s']:.3f} | {cells} | "
              f"{r['total_s']:.3f} | {vs} | {r['peak_phase_mib']:.0f} ({r['peak_phase']}) | {micro} |")
    if report.get("planner"):
        print("\nplanner alone, from counts (unmerged step rows of the same workload, dp and cap as above):")
        print("| step rows | verl's Karmarkar-Karp candidate | layout (s) | plan (s) | of which packing (s) | "
              "micro-batches (lower bound) |")
        print("|---:|---|---:|---:|---:|---|")
        for p in report["planner"]:
            print(f"| {p['rows']} | {'yes (production)' if p['verl_cut'] else 'no'} | {p['layout_s']:.3f} | "
                  f"{p['plan_s']:.3f} | {p['plan_internal_s'].get('packing_s', 0):.3f} | "
                  f"{p['micro_batches']:.0f} ({p['micro_batches_lower_bound']:.0f}) |")


def main(argv=None) -> int:
    args = _args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    w = workload.Workload(args.prompts, args.n, args.max_turns, args.prompt_len, args.response_len,
                          args.token_scale, args.seed)
    tr = workload.draw(w)
    tensors, non_tensors = workload.rollout_batch(w, tr)
    args.step_rows = int(tr.calls.sum())
    report = {"config": {k: x for k, x in vars(args).items() if k != "json"}, "workload": w.describe(),
              "trajectories": int(tr.calls.size), "step_rows": args.step_rows, "calls_mean": float(tr.calls.mean()),
              "calls_max": int(tr.calls.max()), "build_s": time.perf_counter() - t0}
    report["results"] = [run_variant(args, tensors, non_tensors, k) for k in args.variants.split(",")]
    _vs_stock(report["results"])
    if args.planner_rows:
        report["planner"] = planner_scaling(args)
    report["wall_s"] = time.perf_counter() - t0
    report["max_rss_mib"] = __import__("resource").getrusage(__import__("resource").RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(report, indent=2, default=float) if args.json else "", end="")
    if not args.json:
        print_table(report)
        print(f"wall {report['wall_s']:.1f} s; peak RSS of the process {report['max_rss_mib']:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
