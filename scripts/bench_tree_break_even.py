#!/usr/bin/env python
"""The prefix tree's break-even: one real actor update's time against the share of tokens a tree saves, trees and
rows side by side, and the cost model (``verl_traj/core/trees/tree_cost.py``) checked against it.

Runs ``scripts/bench_update.py`` (verl's actor engine worker, FSDP on CPU, remove-padding, every variant on the
flash-attention path) on its sweep cases: GRPO 8 x 8 whose groups share the first 0, 25, 50, 75 or 100% of their
prompts (``share_*``), and ``low_share`` (every prompt distinct behind one 32-token system prompt). Variants:

* ``stock``: verl 0.9.1 (the v1 trainer's order, verl's micro-batches and loss);
* ``traj``: verl_traj's plan, rows (``traj.prefix_tree=false``);
* ``traj_tree``: every micro-batch a prefix tree;
* ``traj_auto``: the default, each micro-batch a tree or rows by this device's cost model;
* ``traj_auto cost=X``: the same under ``traj.tree_token_cost=X`` (default 2.19, the CUDA figure: the mix of trees
  and rows a GPU run would choose, run here).

Per case: the sharing (``1 - tree tokens / row tokens``), seconds per update, the tree's time over the rows' (median of
per-repeat ratios), the tree token's cost in row tokens that the measurement implies (``(t_tree / t_rows) /
(tree tokens / row tokens)``: the model's ``tree_token``), and the share of micro-batches each auto variant ran as
trees. Below the table: the least-squares line ``t_tree / t_rows = a x (tree tokens / row tokens) + b`` over the cases
and the break-even sharing it gives beside the cost model's.

    python scripts/bench_tree_break_even.py [--repeats 3] [--dp 2] [--tree-costs 2.19] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_update  # noqa: E402

from verl_traj.core.trees.tree_cost import DEVICE_COSTS  # noqa: E402

SWEEP = ["low_share", "share_0", "share_25", "share_50", "share_75", "share_100"]


def _ratio(r: dict, base: dict) -> float:
    return statistics.median(t / b for t, b in zip(r["seconds_all"], base["seconds_all"]))


def _tree_share(r: dict) -> float:
    """The share of a variant's micro-batches that ran as trees (its ``row_micro_batches`` per rank of its planned
    ones: the planner cuts units whose trees do not pay into rows, so each variant has its own count)."""
    return 1.0 - float(r.get("row_micro_batches") or 0.0) / max(r["micro_batches_planned"], 1)


def curve(report: dict) -> list[dict]:
    """One point per case: sharing, seconds per variant, tree/rows, the implied tree-token cost, the autos' shares."""
    points = []
    for name, res in report["results"].items():
        rows, tree = res["traj"], res["traj_tree"]
        token_ratio = tree["tree_tokens"] / tree["row_tokens"]
        autos = {v: r for v, r in res.items() if v.startswith("traj_auto")}
        points.append({
            "case": name, "sharing": 1.0 - token_ratio, "row_tokens": tree["row_tokens"],
            "tree_tokens": tree["tree_tokens"], "seconds": {v: r["seconds_per_update"] for v, r in res.items()},
            "tree_over_rows": _ratio(tree, rows), "implied_tree_token_cost": _ratio(tree, rows) / token_ratio,
            "auto_over_rows": {v: _ratio(r, rows) for v, r in autos.items()},
            "auto_over_stock": {v: _ratio(r, res["stock"]) for v, r in autos.items()},
            "auto_tree_share": {v: _tree_share(r) for v, r in autos.items()},
        })
    return points


def fit(points: list[dict], margin: float) -> dict:
    """``t_tree / t_rows = a x q + b`` (``q`` tree tokens over row tokens) by least squares, and the break-even
    sharing it implies at ``margin`` (the tree runs where it is predicted ``1 - margin`` of the rows' time or less)."""
    q = np.array([1.0 - p["sharing"] for p in points])
    y = np.array([p["tree_over_rows"] for p in points])
    a, b = np.polyfit(q, y, 1)
    break_even = float(np.clip(1.0 - ((1.0 - margin) - b) / a, 0.0, 1.0)) if a > 0 else 0.0
    return {"a": float(a), "b": float(b), "break_even_sharing": break_even}


def table(points: list[dict], line: dict) -> str:
    autos = list(points[0]["auto_over_rows"])
    head = ["case", "sharing", "row tokens", "tree tokens", "stock s", "rows s", "trees s", "trees / rows",
            "implied tree_token", *[f"{v} / rows (tree share)" for v in autos]]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in points:
        s = p["seconds"]
        cells = [p["case"], f"{p['sharing']:.0%}", f"{p['row_tokens']:,}", f"{p['tree_tokens']:,.0f}",
                 f"{s['stock']:.3f}", f"{s['traj']:.3f}", f"{s['traj_tree']:.3f}", f"{p['tree_over_rows']:.2f}x",
                 f"{p['implied_tree_token_cost']:.2f}",
                 *[f"{p['auto_over_rows'][v]:.2f}x ({p['auto_tree_share'][v]:.0%})" for v in autos]]
        out.append("| " + " | ".join(cells) + " |")
    model = {k: (m.tree_token, m.break_even_sharing(1e12)) for k, m in DEVICE_COSTS.items()}
    out.append(f"\nfit over the cases: t_tree / t_rows = {line['a']:.2f} x (tree tokens / row tokens) "
               f"{line['b']:+.2f}; break-even sharing {line['break_even_sharing']:.0%} at margin "
               f"{DEVICE_COSTS['cpu'].margin}. Cost model: " + ", ".join(
                   f"{k} tree_token {t:.2f} (break-even {b:.0%})" for k, (t, b) in model.items()))
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--cases", nargs="+", default=SWEEP, choices=SWEEP)
    ap.add_argument("--tree-costs", nargs="*", type=float, default=[round(DEVICE_COSTS["cuda"].tree_token, 2)])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    autos = ["traj_auto", *[f"traj_auto cost={c:g}" for c in args.tree_costs]]
    bench_args = bench_update._parser().parse_args(
        ["--dp", str(args.dp), "--remove-padding", "--tree", "--repeats", str(args.repeats), "--cases", *args.cases,
         "--tree-costs", *map(str, args.tree_costs), "--variants", "traj", "traj_tree", *autos])
    report = bench_update.run(bench_args)
    points = curve(report)
    line = fit(points, DEVICE_COSTS["cpu"].margin)
    if args.json:
        print(json.dumps({"config": report["config"], "points": points, "fit": line, "results": report["results"]},
                         indent=2))
    else:
        print(f"actor update on CPU, dp={args.dp}, remove-padding, cpu_varlen for every variant, median of "
              f"{args.repeats} (alternating, after one warm-up each)")
        print(table(points, line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
