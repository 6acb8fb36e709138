#!/usr/bin/env python
"""Benchmark: a micro-batch's prefix tree built by the worker from its token ids (before issue 40) vs from the plan's
tree facts (now), per pass, and what the driver pays once per step.

Torch (and numpy) only: no verl. Variants, each per micro-batch (medians of ``--repeats``, round-robin):

* ``worker/rows``  -- what every tree pass did per micro-batch before: the ids copied to the host, the trie built
  there (:func:`~verl_traj.core.trees.prefix_tree.build_prefix_tree`) and checked
  (:func:`~verl_traj.core.kernels.tree_attention.check_tree`), the tree copied back to the device;
* ``worker/facts`` -- now: each row token's tree index from the rows' segments
  (:func:`~verl_traj.core.trees.tree_facts.segment_tree_index`), then
  :func:`~verl_traj.core.trees.tree_facts.tree_from_facts` on the rows' device (scatters and a cumulative sum, the
  exactness checks counted there);
* ``driver/facts`` -- :func:`~verl_traj.core.trees.tree_facts.micro_batch_tree_facts` on the host, once per step for all
  passes (old log-probs, reference, values, every update epoch).

``syncs`` counts the ``aten::_local_scalar_dense`` calls of one build (the profiler records one per ``.item()`` /
``int()`` / ``bool()`` of a tensor; on a GPU each is a device-to-host sync, and the old path's copies of ids and tree
are further syncs the count does not show). ``per step`` multiplies the worker's cost by ``--passes`` (default 4:
old log-probs, reference, one update epoch, the GSPO pre-pass or a second epoch) and adds the driver's.

Workloads: ``grpo-8`` / ``grpo-16`` (n responses of 512 tokens behind one 2K-token prompt) and ``steps`` (one row per
LLM call of a 12-turn agent trajectory, 1K-token system prompt, 128-token observations and actions, a quarter of the
actions re-encoded in the next prompt). ``--quick`` scales down.

Usage:
    python scripts/bench_tree_facts.py                  # CPU, table
    python scripts/bench_tree_facts.py --quick --json
    python scripts/bench_tree_facts.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from verl_traj.core.trees.prefix_tree import build_prefix_tree  # noqa: E402
from verl_traj.core.kernels.tree_attention import check_tree  # noqa: E402
from verl_traj.core.trees.tree_facts import segment_tree_index, micro_batch_tree_facts, tree_from_facts  # noqa: E402

VOCAB = 32000


def workloads(quick: bool) -> dict[str, list[list[int]]]:
    """Row sets (token ids), each one micro-batch."""
    rng = np.random.default_rng(0)
    scale = 4 if quick else 1

    def toks(n: int) -> list[int]:
        return rng.integers(3, VOCAB, n // scale).tolist()

    out = {}
    for n in (8, 16):
        prompt = toks(2048)
        out[f"grpo-{n}"] = [prompt + toks(512) for _ in range(n)]
    context, rows = toks(1024), []
    for turn in range(12):
        action = toks(128)
        rows.append(context + action)
        if turn % 4 == 3:
            action = action[:-1] + toks(scale)  # re-encoded: the next prompt differs in the action's last token
        context = context + action + toks(128)
    out["steps"] = rows
    return out


def _inputs(rows: list[list[int]], device: str) -> dict:
    """The worker's micro-batch (packed ids, position ids, row offsets on ``device``) and the plan's facts."""
    facts = micro_batch_tree_facts(rows, np.zeros(len(rows), dtype=np.int64))
    lengths = [len(r) for r in rows]
    return {"ids": torch.tensor([t for r in rows for t in r], device=device),
            "pos": torch.cat([torch.arange(n) for n in lengths]).to(device),
            "offsets": torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), device=device),
            "segment": torch.from_numpy(facts.segment).to(device), "size": int(facts.size[0]), "rows": rows}


def worker_rows(x: dict) -> torch.Tensor:
    """Before: ids to the host, the trie built and checked there, the tree back to the device."""
    offsets = x["offsets"].cpu()
    rows = list(torch.split(x["ids"].cpu(), offsets.diff().tolist()))
    tree = build_prefix_tree(rows)
    check_tree(tree.subtree_end, tree.position_ids)
    return tree.subtree_end.to(x["ids"].device)


def worker_facts(x: dict) -> torch.Tensor:
    """Now: the tree from the plan's facts (each row's segment) on the rows' device."""
    index = segment_tree_index(x["offsets"], x["segment"], x["ids"].shape[0])
    return tree_from_facts(x["ids"], x["pos"], x["offsets"], index, x["size"]).subtree_end


def driver_facts(x: dict) -> torch.Tensor:
    """The driver, once per step: the micro-batch's tree facts from the host rows."""
    return torch.from_numpy(micro_batch_tree_facts(x["rows"], np.zeros(len(x["rows"]), dtype=np.int64)).segment)


VARIANTS = {"worker/rows": worker_rows, "worker/facts": worker_facts, "driver/facts": driver_facts}


def _time(fn, x: dict, cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(x)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _syncs(fn, x: dict) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(x)
    return sum(e.count for e in prof.key_averages() if e.key == "aten::_local_scalar_dense")


def run(args) -> dict:
    cuda = args.device == "cuda"
    out = {}
    for name, rows in workloads(args.quick).items():
        x = _inputs(rows, args.device)
        ref = worker_rows(x)
        assert torch.equal(worker_facts(x), ref), name  # the same tree
        times = {v: [] for v in VARIANTS}
        for _ in range(args.repeats + 1):  # the first round warms up
            for v, fn in VARIANTS.items():
                times[v].append(_time(fn, x, cuda))
        ms = {v: 1000 * statistics.median(t[1:]) for v, t in times.items()}
        out[name] = {"rows": len(rows), "row_tokens": sum(map(len, rows)), "tree_tokens": x["size"], "ms": ms,
                     "syncs": {v: _syncs(fn, x) for v, fn in VARIANTS.items() if v.startswith("worker")},
                     "per_step_ms": {"before": args.passes * ms["worker/rows"],
                                     "now": args.passes * ms["worker/facts"] + ms["driver/facts"]}}
    return out


def table(res: dict, args) -> str:
    head = (f"device {args.device}, median of {args.repeats}; "
            f"per step = {args.passes} passes x worker (+ driver once)\n"
            "| workload | rows | row / tree tokens | worker/rows | worker/facts | driver/facts | syncs rows / facts "
            "| per step before / now |\n|---|---|---|---|---|---|---|---|")
    lines = [f"| {n} | {r['rows']} | {r['row_tokens']:,} / {r['tree_tokens']:,} | {r['ms']['worker/rows']:.2f} ms | "
             f"{r['ms']['worker/facts']:.2f} ms | {r['ms']['driver/facts']:.2f} ms | {r['syncs']['worker/rows']} / "
             f"{r['syncs']['worker/facts']} | {r['per_step_ms']['before']:.2f} / {r['per_step_ms']['now']:.2f} ms |"
             for n, r in res.items()]
    return "\n".join([head, *lines])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    res = run(args)
    print(json.dumps(res, indent=1) if args.json else table(res, args))


if __name__ == "__main__":
    main()
