#!/usr/bin/env python
"""Per-turn baselines when the policy decides when to stop: the estimate's mean against the true advantage.

A search game with known values (``verl_traj.testing.stopping_game``): each turn the agent may find the answer (p=0.5);
found, it answers (+1, stop; probability 0.8) or searches on (-0.1); not found, it gives up (0, stop; 0.3) or searches
on; four turns at most. GRPO groups of 8 trajectories. For each (turn, state, action) with at least 500 calls that had
a peer in their step group, the mean step-level estimate of each baseline (through ``verl_traj.stepwise.step_groups``):

* ``turn_index``, leave-one-out: step groups keyed by turn index (verl RFC 7244's per-turn normalisation);
* ``anchor``, leave-one-out: keyed by state (``traj.step_group_baseline=leave_one_out``);
* ``anchor``, gigpo mean: keyed by state, the group mean including the call itself (GiGPO without std).

    python scripts/bench_step_baselines.py [--groups 4000] [--seed 0] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

from verl_traj.testing.stopping_game import baseline_estimates, estimate_cells, stopping_game

VARIANTS = (("turn_index", "leave_one_out"), ("anchor", "leave_one_out"), ("anchor", "gigpo"))


def run(groups: int, seed: int) -> list[dict]:
    calls, true = stopping_game(groups=groups, n=8, turns=4, seed=seed)
    rows = {}
    for key, baseline in VARIANTS:
        est, peer = baseline_estimates(calls, 8, key, baseline)
        for c in estimate_cells(calls, true, est, peer):
            row = rows.setdefault((c["turn"], c["found"], c["action"]), {"turn": c["turn"], "found": bool(c["found"]),
                                                                         "stops": bool(c["action"]), "true": c["true"]})
            row[f"{key}/{baseline}"] = c["mean"]
    return [r for r in rows.values() if all(f"{k}/{b}" in r for k, b in VARIANTS)]


def table(rows: list[dict]) -> str:
    head = "| turn, state, action | true | " + " | ".join(f"{k}, {b}" for k, b in VARIANTS) + " |"
    lines = [head, "|" + "---|" * (2 + len(VARIANTS))]
    for r in rows:
        action = ("answer" if r["found"] else "give up") if r["stops"] else "search on"
        cells = " | ".join(f"{r[f'{k}/{b}']:+.3f}" for k, b in VARIANTS)
        lines.append(f"| {r['turn']}, {'found' if r['found'] else 'not found'}, {action} | {r['true']:+.3f} | {cells} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = run(args.groups, args.seed)
    print(json.dumps(rows, indent=2) if args.json else table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
