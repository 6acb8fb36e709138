#!/usr/bin/env python
"""Sessions that branch (issue 56): what each way of training them forwards and trains, and one real actor update's
time, side by side in one run.

Synthetic branching sessions with SWE-bench call lengths (``verl_traj.testing.branching.swebench_sessions``: a trunk,
forks of 2-4 branches nested 1-3 deep, 4-30 calls, each call's response and observation lengths from one SWE-bench
trajectory of ``../shared/data`` divided by ``--scale``; GRPO groups of ``--n`` sessions on one task). Layouts:

* ``tree`` (verl_traj, the default ``traj.branch_weighting=once``): the call tree's rows (a fork's later branch a row
  with the shared context as masked prompt), each call's tokens trained once;
* ``paths`` (what the peers do: Tree-GRPO, TreeRL, miles; ``traj.branch_weighting=paths``): every root-to-leaf path
  its own rows, each shared call trained once per path below it;
* ``chain`` (verl_traj before issue 56): the calls recorded as one chain in issue order (concurrent branches
  interleave: each next call one whose parent has been issued, at random), a call that does not extend the previous
  one a row of its own with its whole context; its credit follows issue order (a fork's branches chained, not
  siblings). Issued depth-first, the chain's rows would be the tree's.

Per layout: rows, row tokens (what rows forward), tree tokens (a prefix tree per GRPO group's rows: what
``traj.prefix_tree`` forwards when a group's rows share a micro-batch), loss tokens (what trains; ``tree``'s are each
distinct call token once), and the expansion's seconds. With ``--update``: one real actor update per layout on CPU
(``scripts/bench_update.py``'s worker, FSDP on ``--dp`` gloo ranks, remove-padding, cpu_varlen): ``traj`` (rows) and
``traj_tree`` (every micro-batch a prefix tree), seconds per update and over ``tree``'s ``traj_tree``.

    python scripts/bench_branching.py [--groups 16] [--n 4] [--scale 32] [--update] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

LAYOUTS = ("tree", "paths", "chain")


def layout_batch(layout: str, groups: int, n: int, seed: int, vocab: int, scale: int):
    """``(ExpandedBatch, seconds)``: the sessions' step rows in ``layout``, prefix-merged, and the expansion's time."""
    from verl_traj.stepwise.expand import expand_step_rows
    from verl_traj.testing.branching import as_chain_records, branching_batch, swebench_sessions

    sessions, uids = swebench_sessions(groups, n, seed, vocab, scale)
    if layout == "chain":
        for s in sessions:
            s.records = as_chain_records(s)
    tensors, non = branching_batch(sessions, uids, [1.0] * len(sessions))
    t0 = time.perf_counter()
    out = expand_step_rows(tensors, non, merge_prefix=True, branch_paths=layout == "paths")
    return out, time.perf_counter() - t0


def token_report(layout: str, groups: int, n: int, seed: int, vocab: int, scale: int) -> dict:
    from verl_traj.core.trees.prefix_tree import tree_token_count

    out, seconds = layout_batch(layout, groups, n, seed, vocab, scale)
    attn = out.tensors["attention_mask"].bool()
    rows = [ids[a] for ids, a in zip(out.tensors["input_ids"], attn)]
    uid = out.non_tensors["uid"]
    tree_tokens = sum(tree_token_count([r for r, u in zip(rows, uid) if u == g])[0] for g in sorted(set(uid)))
    return {"rows": len(rows), "row_tokens": int(attn.sum()), "tree_tokens": tree_tokens,
            "loss_tokens": int(out.tensors["response_mask"].sum()), "calls": out.stats.rows_before,
            "call_tokens": out.stats.tokens_before, "expand_s": seconds}


def update_report(args) -> dict:
    """One real actor update per layout (``bench_update``'s ``branching_*`` cases), rows and trees."""
    import bench_update

    cases = [f"branching_{layout}" for layout in LAYOUTS]
    bench_args = bench_update._parser().parse_args(
        ["--dp", str(args.dp), "--remove-padding", "--tree", "--repeats", str(args.repeats), "--seed", str(args.seed),
         "--cases", *cases, "--variants", "traj", "traj_tree", "--case-set", f"groups={args.groups}", f"n={args.n}",
         f"scale={args.scale}", f"seed={args.seed}"])
    return bench_update.run(bench_args)["results"]


def table(tokens: dict, updates: dict | None) -> str:
    base = tokens["tree"]
    lines = ["| layout | rows | row tokens | tree tokens | loss tokens | row tokens / tree's | loss tokens / tree's "
             "| expand s |" + (" rows s/update | trees s/update | trees / tree layout's |" if updates else ""),
             "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if updates else "")]
    ref = updates["branching_tree"]["traj_tree"]["seconds_all"] if updates else None
    for layout in LAYOUTS:
        r = tokens[layout]
        line = (f"| {layout} | {r['rows']} | {r['row_tokens']} | {r['tree_tokens']} | {r['loss_tokens']} | "
                f"{r['row_tokens'] / base['row_tokens']:.2f} | {r['loss_tokens'] / base['loss_tokens']:.2f} | "
                f"{r['expand_s']:.3f} |")
        if updates:
            u = updates[f"branching_{layout}"]
            paired = statistics.median(t / b for t, b in zip(u["traj_tree"]["seconds_all"], ref))
            line += (f" {u['traj']['seconds_per_update']:.2f} | {u['traj_tree']['seconds_per_update']:.2f} | "
                     f"{paired:.2f} |")
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--scale", type=int, default=32, help="SWE-bench token lengths divided by this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--update", action="store_true", help="also time one real actor update per layout (CPU)")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    tokens = {layout: token_report(layout, args.groups, args.n, args.seed, args.vocab, args.scale)
              for layout in LAYOUTS}
    updates = update_report(args) if args.update else None
    report = {"config": vars(args), "tokens": tokens, "updates": updates}
    print(json.dumps(report, indent=2) if args.json else "\n".join([
        f"{args.groups * args.n} branching sessions ({args.groups} GRPO groups x {args.n}), SWE-bench call lengths / "
        f"{args.scale}: {tokens['tree']['calls']} calls, {tokens['tree']['call_tokens']} tokens as one row per call",
        table(tokens, updates)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
