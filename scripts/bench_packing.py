#!/usr/bin/env python
"""Benchmark: micro-batches the planner runs vs the fewest possible (issue 40, item 5).

Each rank runs the same number of micro-batches per mini-batch (verl syncs the count), so a mini-batch costs
``max over ranks`` of each rank's count. The lower bound the plan reports is, per rank, Martello-Toth's L2 (at least
``ceil(tokens / cap)`` and the rows over ``cap / 2``) raised where the exact search proved a count impossible; the
former bound was ``ceil(rank tokens / cap)``. Methods, on the same plans (same mini-batches and ranks):

* ``verl_traj``: the planner as shipped (token cost: every block at ``ceil(tokens / cap)`` batch-wide, LPT in rounds
  and a swap repair, ``core/packing/batch_packing.py``; blocks it does not fit: exact bin-completion search from the bound
  up, then LPT repaired by a local search, verl's KK, BFD; with the padded cost also low-padding packings at the
  count);
* ``heuristics only``: the same without the batch-wide pass, the exact search and the local search (LPT, verl's
  Karmarkar-Karp, best-fit decreasing: what the planner ran before on blocks over 24 rows);
* ``verl re-cut``: what verl's ``rearrange_micro_batches`` cuts the same blocks into (token cost only).

The rank-free bound ignores the plan's rank assignment: ``ceil(L2(all rows of the mini-batch) / dp)`` per mini-batch
(dp ranks of k micro-batches hold at most dp x k bins); where it is below the lower bound, a cap-aware rank
assignment could save micro-batches.

Workloads: the quick start's rows (calculator agent, one merged row per episode: prompt 159-163 tokens, response
``gamma(2.5, 38) + 3`` clipped at 256, 3% truncated at 256; 16 prompts x 4, 2 mini-batches, cap 2048), and
batches of 32 SWE-bench trajectories (one row per step, ``group_by=trajectory``, 4 mini-batches, cap 131072).

Usage: ``python scripts/bench_packing.py [--batches 40] [--json] [--write docs/bench_packing.md]``; a run's own
rows: ``VERL_TRAJ_DEBUG_DUMP=DIR python -m verl_traj.quickstart``, then
``python scripts/bench_packing.py --dump DIR/plan.jsonl [--cap 2048 --pass-cost 1024]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np

import verl_traj.core.packing.bin_packing as bin_packing
import verl_traj.core.packing.packing as packing
import verl_traj.core.packing.padded_packing as padded_packing
from verl_traj.core import build_layout_from_counts, plan_mini_batches
from verl_traj.core.packing.bin_packing import bin_lower_bound
from verl_traj.integration.trainers.step_plan import verl_partitioner
from verl_traj.testing.swebench import DATA_FILE, load_step_rows


def quickstart_batch(rng: np.random.Generator) -> dict:
    n = 64
    response = np.clip(rng.gamma(2.5, 38, n).astype(np.int64) + 3, 3, 256)
    tokens = rng.integers(159, 164, n) + np.where(rng.random(n) < 0.03, 256, response)
    return dict(tokens=tokens, uid=np.array([f"g{i // 4}" for i in range(n)], dtype=object),
                traj=np.array([f"t{i}" for i in range(n)], dtype=object), step=np.zeros(n, dtype=np.int64),
                cap=2048, M=2, group_by="group")


def swebench_sampler(path=DATA_FILE):
    rows = load_step_rows(path)
    traj = np.asarray(rows["traj_id"]).astype(str)
    names = np.unique(traj)
    tokens = np.asarray(rows["prompt_tokens"]) + np.asarray(rows["response_tokens"])

    def batch(rng: np.random.Generator) -> dict:
        keep = np.isin(traj, rng.choice(names, 32, replace=False))
        return dict(tokens=tokens[keep], uid=np.asarray(rows["uid"], dtype=object)[keep],
                    traj=traj[keep].astype(object), step=np.asarray(rows["step_index"])[keep], cap=131_072, M=4,
                    group_by="trajectory")
    return batch


@contextmanager
def exact_search_off():
    """The planner's packer with no batch-wide pass, no exact search and no local search: LPT, verl's KK, BFD."""
    saved = (packing.fewest_bins, packing._batch_wide, padded_packing.pack_into, padded_packing.repaired_bins,
             bin_packing.REPAIR_STEPS)
    packing.fewest_bins = partial(saved[0], budget=0)
    packing._batch_wide = lambda sorted_tokens, starts, rows, cap, cost: saved[1](sorted_tokens, starts, rows, cap,
                                                                                   "padded")  # nothing done
    padded_packing.pack_into = lambda *a, **k: (None, False)
    padded_packing.repaired_bins = lambda *a, **k: None
    bin_packing.REPAIR_STEPS = 0
    try:
        yield
    finally:
        (packing.fewest_bins, packing._batch_wide, padded_packing.pack_into, padded_packing.repaired_bins,
         bin_packing.REPAIR_STEPS) = saved


def block_lengths(plan, tokens: np.ndarray) -> list[list[np.ndarray]]:
    """``[M][dp]`` attended tokens of each rank's rows of each mini-batch (padding rows included)."""
    order, mb, rank = plan.order.numpy(), plan.mini_batch_id.numpy(), plan.rank.numpy()
    lens = np.where(order >= 0, tokens[np.maximum(order, 0)], plan.spec.pad_row_tokens)
    return [[lens[(mb == m) & (rank == r)] for r in range(plan.dp_size)] for m in range(plan.num_mini_batches)]


def verl_recut(blocks: list[list[np.ndarray]], cap: int) -> int:
    """Micro-batches (summed over mini-batches) verl's ``rearrange_micro_batches`` cuts the same blocks into."""
    import torch
    from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions

    total = 0
    for ranks in blocks:
        k = max(min(len(x), -(-int(x.sum()) // cap)) for x in ranks)
        while not all(int(x[q].sum()) <= cap for x in ranks for q in get_seqlen_balanced_partitions(
                calculate_workload(torch.from_numpy(x)).tolist(), k, equal_size=False)):
            k += 1
        total += k
    return total


def one_plan(b: dict, dp: int, cost: str):
    lay = build_layout_from_counts(b["tokens"], b["tokens"] // 3, b["uid"], b["traj"], b["step"])
    return plan_mini_batches(lay, b["M"], dp, group_by=b["group_by"], micro_batch_max_tokens=b["cap"],
                             micro_batch_cost=cost, micro_batch_pass_cost=1024 if cost == "padded" else None,
                             partitioner=verl_partitioner)


def measure(batches: list[dict], dp: int, cost: str) -> dict[str, dict]:
    """Sums over the batches per method: micro-batches, bound, former bound, mini-batches above the bound."""
    out: dict[str, dict] = {}
    for method in ("verl_traj", "heuristics only", "verl re-cut"):
        if method == "verl re-cut" and cost != "tokens":
            continue
        acc = dict(mini_batches=0, micro_batches=0, lower_bound=0, former_bound=0, rank_free_bound=0, over=0,
                   packing_s=0.0, padded_share=0.0 if method != "verl re-cut" and cost != "tokens" else None)
        for b in batches:
            with exact_search_off() if method == "heuristics only" else _nothing():
                plan = one_plan(b, dp, cost)
            s, blocks = plan.stats, block_lengths(plan, b["tokens"])
            counts = np.array([verl_recut([ranks], b["cap"]) for ranks in blocks]) if method == "verl re-cut" \
                else s.micro_batches.numpy()
            acc["mini_batches"] += plan.num_mini_batches
            acc["micro_batches"] += int(counts.sum())
            acc["lower_bound"] += int(s.micro_batches_lower_bound.sum())
            acc["former_bound"] += sum(max(-(-int(x.sum()) // b["cap"]) for x in ranks) for ranks in blocks)
            acc["rank_free_bound"] += sum(-(-bin_lower_bound(np.concatenate(ranks).tolist(), b["cap"]) // dp)
                                          for ranks in blocks)
            acc["over"] += int((counts > s.micro_batches_lower_bound.numpy()).sum())
            acc["packing_s"] += plan.timing_s["packing_s"] if method != "verl re-cut" else 0.0
            if acc["padded_share"] is not None:
                acc["padded_share"] += plan.metrics()["traj_plan/padded_positions_share"] / len(batches)
        out[method] = acc
    return out


@contextmanager
def _nothing():
    yield


def replay_dump(path: str, cap: int, pass_cost: int) -> list[dict]:
    """Per step of a debug dump (``VERL_TRAJ_DEBUG_DUMP``'s ``plan.jsonl``: each row's attention length and
    mini-batch, dp = 1): micro-batches and bound of the step's mini-batches, per cost and method."""
    out = []
    for line in open(path):
        rec = json.loads(line)
        mb, lengths, m = np.array(rec["mini_batch_id"]), np.array(rec["attention_length"]), rec["num_mini_batches"]
        row = dict(step=rec["step"])
        for cost in ("tokens", "padded"):
            for method in ("verl_traj", "heuristics only"):
                with exact_search_off() if method == "heuristics only" else _nothing():
                    p = packing.pack_micro_batches(lengths, mb, np.arange(m), m, cap, cost=cost,
                                                   partitioner=verl_partitioner,
                                                   pass_cost=pass_cost if cost == "padded" else None)
                row[f"{cost}/{method}"] = int(p.block_count.sum())
            row["bound"] = int(p.block_lower_bound.sum())
        out.append(row)
    return out


def dump_table(rows: list[dict]) -> str:
    keys = [k for k in rows[0] if "/" in k]
    lines = ["| step | " + " | ".join(keys) + " | lower bound |", "|---" * (len(keys) + 2) + "|"]
    lines += [f"| {r['step']} | " + " | ".join(str(r[k]) for k in keys) + f" | {r['bound']} |" for r in rows]
    lines.append("| steps above the bound | " + " | ".join(str(sum(r[k] > r["bound"] for r in rows)) for k in keys) + " | |")
    return "\n".join(lines)


HEADER = ("| workload | dp | cost | method | mini-batches | micro-batches run | lower bound (former: ceil) | "
          "rank-free bound | mini-batches above the bound | padded positions share | packing time (s) |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")


def table(results: list[dict]) -> str:
    lines = [HEADER]
    for r in results:
        share = "-" if r["padded_share"] is None else f"{r['padded_share']:.3f}"
        lines.append(f"| {r['workload']} | {r['dp']} | {r['cost']} | {r['method']} | {r['mini_batches']} | "
                     f"{r['micro_batches']:,} | {r['lower_bound']:,} ({r['former_bound']:,}) | "
                     f"{r['rank_free_bound']:,} | {r['over']} | {share} | {r['packing_s']:.2f} |")
    return "\n".join(lines)


def run(num_batches: int) -> list[dict]:
    workloads = [("calculator agent (quick start)", quickstart_batch, (1, 2, 4), ("tokens", "padded"))]
    if DATA_FILE.exists():
        workloads.append(("swebench, 32 trajectories", swebench_sampler(), (1, 2, 8), ("tokens",)))
    else:
        print(f"[bench] {DATA_FILE} absent: SWE-bench rows skipped", file=sys.stderr)
    results = []
    for name, make, dps, costs in workloads:
        rng = np.random.default_rng(0)
        batches = [make(rng) for _ in range(num_batches)]
        for dp in dps:
            for cost in costs:
                for method, acc in measure(batches, dp, cost).items():
                    results.append(dict(workload=name, dp=dp, cost=cost, method=method, batches=num_batches, **acc))
                print(f"[bench] {name} dp={dp} {cost} done", file=sys.stderr)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=40, help="training batches per workload")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ap.add_argument("--write", type=str, default=None, help="also write the markdown table to this file")
    ap.add_argument("--dump", type=str, default=None, help="replay a debug dump's plan.jsonl instead (dp = 1)")
    ap.add_argument("--cap", type=int, default=2048, help="--dump: the run's micro-batch cap (quick start: 2048)")
    ap.add_argument("--pass-cost", type=int, default=1024, help="--dump: traj.pass_cost_tokens (quick start: 1024)")
    args = ap.parse_args(argv)
    if args.dump:
        rows = replay_dump(args.dump, args.cap, args.pass_cost)
        print(json.dumps(rows, indent=1) if args.json else dump_table(rows))
        return 0
    t0 = time.perf_counter()
    results = run(args.batches)
    text = (f"{args.batches} batches per workload; padded cost: no remove-padding, pass cost 1024 positions (the quick "
            f"start's); lower bound, micro-batches and bounds summed over mini-batches (per rank: verl syncs the "
            f"count); run took {time.perf_counter() - t0:.0f} s on {os.cpu_count()} shared cores.\n\n" + table(results))
    print(json.dumps(results, indent=1) if args.json else text)
    if args.write:
        cmd = f"python scripts/bench_packing.py --batches {args.batches} --write {args.write}"
        Path(args.write).write_text(f"# Micro-batch packing vs its lower bound\n\nReproduce: `{cmd}`\n\n{text}\n\n{__doc__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
