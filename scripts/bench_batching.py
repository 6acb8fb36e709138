#!/usr/bin/env python
"""Benchmark: verl_traj's trajectory-aware batching vs verl 0.9.1's stock `_balance_batch` path.

Both run from this process (verl's Karmarkar-Karp in a spawned child with a time limit, so a slow run
prints "skipped (>N s)" instead of hanging).

verl stock path (replicated from RayPPOTrainer._balance_batch, default branch, and the engine
worker): workload = calculate_workload(attention tokens); get_seqlen_balanced_partitions(workload,
dp, equal_size=True) (Karmarkar-Karp); each partition sorted by (workload, index) and interleaved
(small at both ends); each rank's shard cut into num_mini_batches consecutive equal slices (verl's
make_iterator); micro-batches per (rank, mini-batch) as rearrange_micro_batches(max_token_len=cap)
counts them: ceil(tokens/cap) raised until the KK partition fits the cap, synced as the MAX over
ranks. verl needs B divisible by dp * num_mini_batches: the last B mod (dp*M) rows are dropped for
its run (it has no training-batch padding: it would assert instead).

Ours: build_layout_from_counts + plan_mini_batches(group_by, dp, M, micro_batch_max_tokens=cap)
(per-row token counts, not [B, L] masks: at 1M rows a mask would not fit in memory; apply_plan is
not timed).

Usage:
    python scripts/bench_batching.py            # full run (real data + 10K/100K/1M synthetic), table
    python scripts/bench_batching.py --quick    # real data + 10K synthetic
    python scripts/bench_batching.py --json     # JSON instead of the table
    python scripts/bench_batching.py --write docs/bench_batching.md
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

from verl_traj.core import build_layout_from_counts, calculate_workload, plan_mini_batches

from verl_traj.testing.swebench import DATA_FILE, load_step_rows


# ----------------------------------------------------------------------------------------- workloads
def load_real(path: Path = DATA_FILE) -> dict:
    """One row per step. uid: consecutive trajectories of the same repository (id prefix before '__')."""
    rows = load_step_rows(path)
    uid, tid, step = rows["uid"], rows["traj_id"], rows["step_index"]
    tok, loss = rows["prompt_tokens"] + rows["response_tokens"], rows["response_tokens"]
    return dict(
        name="swebench (real)",
        uid=np.asarray(uid, dtype=object),
        traj_id=np.asarray(tid, dtype=object),
        step_index=np.asarray(step, dtype=np.int64),
        tokens=np.asarray(tok, dtype=np.int64),
        loss=np.asarray(loss, dtype=np.int64),
        note="uid = consecutive trajectories of the same repository (12 groups)",
    )


def make_synthetic(rows: int, seed: int = 0, max_row: int = 32_768) -> dict:
    """Step-wise agent rows: GRPO groups of 4-12 trajectories, 1-50 steps each; prompt grows with the
    step (per-trajectory lognormal base + lognormal observation per step), lognormal responses, clipped
    at ``max_row`` tokens."""
    rng = np.random.default_rng(seed)
    n_traj = int(rows / 25.5 * 1.2) + 8
    steps = rng.integers(1, 51, size=n_traj)
    csum = np.cumsum(steps)
    n_traj = int(np.searchsorted(csum, rows) + 1)
    steps = steps[:n_traj]
    steps[-1] -= int(csum[n_traj - 1] - rows)
    gsz = rng.integers(4, 13, size=n_traj)
    traj_group = np.repeat(np.arange(n_traj), gsz)[:n_traj]  # placeholder, replaced below
    bounds = np.cumsum(gsz)
    traj_group = np.searchsorted(bounds, np.arange(n_traj), side="right")
    row_traj = np.repeat(np.arange(n_traj), steps)
    step = np.arange(rows) - np.repeat(np.cumsum(steps) - steps, steps)
    base = np.exp(rng.normal(7.2, 0.5, size=n_traj))
    obs = np.exp(rng.normal(5.5, 1.0, size=n_traj))
    resp = np.exp(rng.normal(5.0, 1.0, size=rows)).astype(np.int64) + 1
    prompt = (base[row_traj] + step * obs[row_traj]).astype(np.int64)
    tokens = np.minimum(prompt + resp, max_row)
    loss = np.minimum(resp, tokens)
    return dict(
        name=f"synthetic {rows // 1000}K",
        uid=np.char.add("g", traj_group[row_traj].astype(str)).astype(object),
        traj_id=np.char.add("t", row_traj.astype(str)).astype(object),
        step_index=step.astype(np.int64),
        tokens=tokens.astype(np.int64),
        loss=loss.astype(np.int64),
        note="GRPO groups of 4-12 trajectories, 1-50 steps, prompt grows per step, lognormal lengths",
    )


# ----------------------------------------------------------------------------------------- evaluation
def evaluate_assignment(tokens, traj, grp, mb, rank, M, dp, cap, pad_rows=0, pad_tokens=0, micro=None):
    """Common metrics for a (mini-batch, rank) assignment of real rows."""
    w = calculate_workload(tokens, "verl")
    block = mb * dp + rank
    load = np.zeros(M * dp, dtype=np.int64)
    np.add.at(load, block, w)
    load = load.reshape(M, dp)
    tot = load.sum(1)
    mx = np.zeros(M, dtype=np.int64)
    np.maximum.at(mx, mb, w)
    lb = np.maximum(-(-tot // dp), mx)
    ratio = load.max(1) / np.maximum(lb, 1)
    split_t = np.unique(traj * M + mb).shape[0] - np.unique(traj).shape[0]
    split_g = np.unique(grp * M + mb).shape[0] - np.unique(grp).shape[0]
    rank_tok = np.zeros(M * dp, dtype=np.int64)
    np.add.at(rank_tok, block, tokens)
    lbm = int((-(-rank_tok.reshape(M, dp) // cap)).max(1).sum())
    return dict(
        balance_mean=float(ratio.mean()),
        balance_worst=float(ratio.max()),
        split_trajectories=int(split_t),
        split_groups=int(split_g),
        padding_rows=int(pad_rows),
        padding_tokens=int(pad_tokens),
        micro_batches=None if micro is None else int(micro),
        micro_lower_bound=lbm,
    )


def run_ours(wl: dict, M: int, dp: int, cap: int, group_by: str) -> dict:
    t0 = time.perf_counter()
    lay = build_layout_from_counts(wl["tokens"], wl["loss"], wl["uid"], wl["traj_id"], wl["step_index"])
    t1 = time.perf_counter()
    plan = plan_mini_batches(lay, M, dp, group_by=group_by, workload="verl", micro_batch_max_tokens=cap)
    t2 = time.perf_counter()
    order = plan.order.numpy()
    real = order >= 0
    src = order[real]
    res = evaluate_assignment(
        wl["tokens"][src], lay.traj_index.numpy()[src], lay.group_index.numpy()[src],
        plan.mini_batch_id.numpy()[real], plan.rank.numpy()[real], M, dp, cap,
        pad_rows=int(plan.stats.padding_rows.sum()), pad_tokens=int(plan.stats.padding_tokens.sum()),
        micro=int(plan.stats.micro_batches.sum()),
    )
    m = plan.metrics("p")
    # the plan's own numbers (padding rows included in the rank workload) must agree
    res.update(
        method=f"verl_traj (group_by={group_by})",
        plan_s=t2 - t0,
        layout_s=t1 - t0,
        packing_s=plan.timing_s.get("packing_s", 0.0),
        balance_s=plan.timing_s.get("balance_s", 0.0),
        rows=int(lay.num_rows),
        dropped_rows=0,
        plan_balance_worst=m["p/balance_ratio_worst"],
        units_larger_than_mini_batch=plan.units_larger_than_mini_batch,
        micro_lower_bound=int(plan.stats.micro_batches_lower_bound.sum()),
        verl_micro_on_ours=verl_count_on_plan(wl["tokens"], plan, cap) if lay.num_rows <= 30_000 else None,
    )
    return res


def verl_count_on_plan(tokens: np.ndarray, plan, cap: int) -> int:
    """Micro-batches per rank, summed over mini-batches, that verl's ``rearrange_micro_batches`` would cut on
    the plan's own (rank, mini-batch) blocks (its count synced as the max over ranks): what ran before
    the workers ran the plan's micro-batches."""
    import torch
    from verl.utils.seqlen_balancing import calculate_workload as verl_workload
    from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions

    order, mb, rank = plan.order.numpy(), plan.mini_batch_id.numpy(), plan.rank.numpy()
    lens = np.where(order >= 0, tokens[np.maximum(order, 0)], plan.spec.pad_row_tokens)
    total = 0
    for m in range(plan.num_mini_batches):
        blocks = [lens[(mb == m) & (rank == r)] for r in range(plan.dp_size)]
        k = max(min(len(x), -(-int(x.sum()) // cap)) for x in blocks)
        while not all(all(int(x[q].sum()) <= cap for q in get_seqlen_balanced_partitions(
                verl_workload(torch.from_numpy(x)).tolist(), k, equal_size=False)) for x in blocks):
            k += 1
        total += k
    return total


def _verl_child(path_in: str, path_out: str, dp: int, M: int, cap: int, do_micro: bool) -> None:
    import torch
    from verl.utils.seqlen_balancing import calculate_workload as verl_workload
    from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions

    tokens = np.load(path_in)
    t0 = time.perf_counter()
    # --- RayPPOTrainer._balance_batch, default branch
    global_seqlen_lst = torch.from_numpy(tokens)
    workload_lst = verl_workload(global_seqlen_lst)
    parts = get_seqlen_balanced_partitions(workload_lst, k_partitions=dp, equal_size=True)
    for idx, partition in enumerate(parts):
        partition.sort(key=lambda x: (workload_lst[x], x))
        parts[idx] = partition[::2] + partition[1::2][::-1]
    global_idx = torch.tensor([j for partition in parts for j in partition])
    t1 = time.perf_counter()
    np.save(path_out + ".idx.npy", global_idx.numpy())
    with open(path_out + ".time", "w") as f:
        f.write(str(t1 - t0))
    if not do_micro:
        return
    # --- rearrange_micro_batches count per (rank, mini-batch), synced as max over ranks
    per_rank = tokens.shape[0] // dp
    per_mb = per_rank // M
    gi = global_idx.numpy()
    total = 0
    for m in range(M):
        blocks = [gi[r * per_rank + m * per_mb : r * per_rank + (m + 1) * per_mb] for r in range(dp)]
        lens = [tokens[b] for b in blocks]
        n = max(min(len(x), -(-int(x.sum()) // cap)) for x in lens)
        while True:
            ok = True
            for x in lens:
                if n > len(x):
                    ok = None
                    break
                w = verl_workload(torch.from_numpy(x)).tolist()
                p = get_seqlen_balanced_partitions(w, n, equal_size=False)
                if any(int(x[q].sum()) > cap for q in p):
                    ok = False
                    break
            if ok is None:
                n = -1  # verl raises: a rank has fewer rows than the synced count
                break
            if ok:
                break
            n += 1
        total += n if n > 0 else 10**9
    with open(path_out + ".micro", "w") as f:
        f.write(str(total))


def run_verl(wl: dict, M: int, dp: int, cap: int, timeout_s: float, tmpdir: Path, do_micro: bool = True) -> dict:
    B = wl["tokens"].shape[0]
    keep = B - B % (dp * M)
    tokens = wl["tokens"][:keep]
    base = tmpdir / f"verl_{os.getpid()}_{keep}"
    np.save(str(base) + ".in.npy", tokens)
    for ext in (".idx.npy", ".time", ".micro"):
        Path(str(base) + ext).unlink(missing_ok=True)
    # spawn, not fork: a child forked after torch's OpenMP pool started in this process deadlocks in its
    # first parallel op (>= 32K elements), which would look like a KK timeout
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_verl_child, args=(str(base) + ".in.npy", str(base), dp, M, cap, do_micro))
    t_start = time.perf_counter()
    p.start()
    p.join(timeout_s)
    timed_out = p.is_alive()
    if timed_out:
        p.terminate()
        p.join()
    res = dict(method="verl 0.9.1 stock", rows=keep, dropped_rows=B - keep)
    tfile = Path(str(base) + ".time")
    if not tfile.exists():
        res.update(skipped=f"skipped (>{timeout_s:.0f} s)" if timed_out else "failed")
        for ext in (".in.npy", ".idx.npy", ".time", ".micro"):
            Path(str(base) + ext).unlink(missing_ok=True)
        return res
    res["plan_s"] = float(tfile.read_text())
    gi = np.load(str(base) + ".idx.npy")
    per_rank = keep // dp
    per_mb = per_rank // M
    pos = np.arange(keep)
    rank = pos // per_rank
    mb = (pos % per_rank) // per_mb
    _, traj = np.unique(wl["traj_id"][:keep][gi].astype(str), return_inverse=True)
    _, grp = np.unique(wl["uid"][:keep][gi].astype(str), return_inverse=True)
    mfile = Path(str(base) + ".micro")
    micro = int(mfile.read_text()) if mfile.exists() else None
    res.update(evaluate_assignment(tokens[gi], traj.reshape(-1), grp.reshape(-1), mb, rank, M, dp, cap, micro=micro))
    if micro is None and do_micro:
        res["micro_note"] = f"micro-batch count skipped (>{timeout_s:.0f} s)"
    if micro is not None and micro >= 10**9:
        res["micro_batches"] = None
        res["micro_note"] = "verl raises: a rank has fewer rows than the synced micro-batch count"
    res["verl_total_s"] = time.perf_counter() - t_start
    for ext in (".in.npy", ".idx.npy", ".time", ".micro"):
        Path(str(base) + ext).unlink(missing_ok=True)
    return res


# ----------------------------------------------------------------------------------------- main
def fmt_row(wl_name: str, r: dict) -> str:
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    if "skipped" in r:
        return f"| {wl_name} | {r['rows']:,} | {r['method']} | {r['skipped']} | - | - | - | - | - | - |"
    theirs = r.get("verl_micro_on_ours")
    micro = "-" if r.get("micro_batches") is None else (
        f"{r['micro_batches']:,} / {'-' if theirs is None else format(theirs, ',')} / {r['micro_lower_bound']:,}")
    if r.get("micro_note") and r.get("micro_batches") is None:
        micro = r["micro_note"]
    plan_time = f"{r['plan_s']:.3f}"
    if "packing_s" in r:
        plan_time += f" (packing {r['packing_s']:.3f})"
    rows = f"{r['rows']:,}" + (f" (drops {r['dropped_rows']})" if r.get("dropped_rows") else "")
    return (
        f"| {wl_name} | {rows} | {r['method']} | {plan_time} | {r['balance_mean']:.4f} / {r['balance_worst']:.4f} | "
        f"{r['split_trajectories']:,} | {r['split_groups']:,} | {r['padding_rows']:,} / {r['padding_tokens']:,} | {micro} |"
    )


EXPLANATION = """
## What is compared

- **verl 0.9.1 stock**: `RayPPOTrainer._balance_batch` default branch (Karmarkar-Karp `equal_size=True` over dp
  ranks on `calculate_workload`, per-partition sort + interleave), then each rank's contiguous shard cut into
  `M` consecutive equal mini-batches (the engine worker's `make_iterator`), micro-batches counted as
  `rearrange_micro_batches(max_token_len=cap)` does (ceil(tokens/cap) raised until the KK partition fits the cap,
  synced as the max over ranks). Its time is the `_balance_batch` part only (micro-batching runs on the workers).
  verl has no training-batch padding: the last `B mod (dp*M)` rows are dropped for its run.
- **verl_traj**: `build_layout_from_counts` + `plan_mini_batches(..., micro_batch_max_tokens=cap)`: whole
  units (GRPO groups on the synthetic and M=4 real rows; trajectories for M=16 on the real data, which has only
  12 repository groups) per mini-batch, DP balancing with equal rows per rank, minimal padding, token-sum
  micro-batch packing (every block at ceil(tokens / cap) batch-wide: LPT in rounds and a swap repair; the blocks
  that do not fit: from the lower bound up an exact bin-completion search under a work budget, then LPT, verl's
  own Karmarkar-Karp as a candidate, best-fit decreasing) with synced counts: the micro-batches the
  workers run. Its time includes the packing (shown in brackets).
- Micro-batches: per rank, summed over mini-batches. For verl_traj: the planned count (what runs), the count
  verl's `rearrange_micro_batches` would re-cut the SAME blocks into (what ran before verl_traj ran its own
  plan; up to 30K rows), and the plan's lower bound: max over ranks of the fewest micro-batches any packing of
  the rank's rows needs (Martello-Toth L2: at least ceil(rank tokens / cap) and the rows over cap / 2; raised where
  the exact search proved a count impossible). For stock verl: its count on its own blocks / - / max over ranks of
  ceil(rank tokens / cap) of its blocks. Packing alone on tighter blocks (the quick start's rows, SWE-bench
  batches of 32 trajectories, with and without the exact search): `scripts/bench_packing.py`,
  `docs/bench_packing.md`.
- Balance = slowest rank's workload / max(ceil(total/dp), largest row) per mini-batch (1.0 is optimal).
- Split trajectories / groups = (distinct (unit, mini-batch) pairs) - (units): how many extra mini-batches
  the steps of a trajectory / the members of a group were scattered over.
"""

HEADER = (
    "| workload | rows | method | plan time (s), ours incl. micro-batch packing | slowest rank / lower bound (mean / worst mini-batch) | "
    "split trajectories | split groups | padding rows / tokens | micro-batches run / verl's re-cut of the same blocks / lower bound |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="real data + 10K synthetic only")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table (--write still writes the table)")
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--verl-timeout", type=float, default=300.0, help="seconds before verl's KK run is skipped")
    ap.add_argument("--sizes", type=str, default="10000,30000,100000,1000000")
    ap.add_argument("--write", type=str, default=None, help="also write the markdown table to this file")
    args = ap.parse_args(argv)
    dp = args.dp
    tmpdir = Path(os.environ.get("TMPDIR", "/tmp"))
    sizes = [10_000] if args.quick else [int(s) for s in args.sizes.split(",")]

    results = []
    load0 = f"{os.getloadavg()[0]:.1f}"
    if DATA_FILE.exists():
        wl = load_real()
        cap = 131_072  # >= longest row (~90.9K tokens)
        for M, group_by in ((4, "group"), (16, "trajectory")):
            name = f"{wl['name']}, M={M}"
            results.append((name, wl["note"], run_ours(wl, M, dp, cap, group_by)))
            results.append((name, wl["note"], run_verl(wl, M, dp, cap, args.verl_timeout, tmpdir)))
            print(f"[bench] {name} done", file=sys.stderr)
    else:
        print(f"[bench] {DATA_FILE} absent: real-data rows skipped", file=sys.stderr)
    verl_gave_up_at = None
    for n in sizes:
        wl = make_synthetic(n)
        cap = 65_536
        M = 16
        name = f"{wl['name']}, M={M}"
        results.append((name, wl["note"], run_ours(wl, M, dp, cap, "group")))
        if verl_gave_up_at is None:
            r = run_verl(wl, M, dp, cap, args.verl_timeout, tmpdir, do_micro=n <= 100_000)
            if "skipped" in r:
                verl_gave_up_at = n
        else:  # KK is superlinear: a larger batch cannot finish where a smaller one did not
            keep = n - n % (dp * M)
            r = dict(method="verl 0.9.1 stock", rows=keep, dropped_rows=n - keep,
                     skipped=f"skipped (>{args.verl_timeout:.0f} s already at {verl_gave_up_at:,} rows)")
        results.append((name, wl["note"], r))
        print(f"[bench] {name} done", file=sys.stderr)

    notes = sorted({f"- {n.split(',')[0].split(' ')[0]}: {note}" for n, note, _ in results})
    lines = [
        f"dp_size={dp}; cap (micro_batch_max_tokens / verl max_token_len) = 131072 on the real data, 65536 on "
        "synthetic; workload model 24576*L + L^2 (verl's calculate_workload) for both methods.",
        "",
        HEADER,
        *[fmt_row(n, r) for n, _, r in results],
        "",
        *notes,
        "- lower bound per mini-batch = max(ceil(total workload / dp), largest row workload); micro-batches are per rank, "
        "summed over mini-batches (verl syncs the count as the max over ranks).",
        "- verl stock drops the last B mod (dp*M) rows (it would assert on them); it never pads.",
        "- micro-batch column: run / verl's re-cut of the same (rank, mini-batch) blocks / lower bound (max over ranks "
        "of the rank's fewest possible: Martello-Toth L2, >= ceil(rank tokens / cap), raised where the exact search "
        "proved a count impossible; stock verl: ceil(rank tokens / cap)), per rank, summed over mini-batches.",
        "- verl's micro-batch count is computed up to 100K rows only (it reruns KK per rank and mini-batch): '-' above.",
    ]
    table = "\n".join(lines)
    if args.json:
        print(json.dumps([dict(workload=n, note=note, **r) for n, note, r in results], indent=1, default=float))
    else:
        print(table)
    if args.write:
        cmd = "python scripts/bench_batching.py" + (" --quick" if args.quick else f" --sizes {args.sizes}") + f" --dp {dp}"
        cmd += f" --verl-timeout {args.verl_timeout:.0f} --write docs/bench_batching.md"
        Path(args.write).write_text(
            "# Batching benchmark: verl_traj vs verl 0.9.1 stock `_balance_batch`\n\n"
            f"Reproduce: `{cmd}` (machine: {os.cpu_count()} cores; verl's Karmarkar-Karp time-limited at "
            f"{args.verl_timeout:.0f} s; load average during the run {load0} -> {os.getloadavg()[0]:.1f}: "
            "other jobs shared the machine, so times are noisy, ratios are not).\n\n" + table + "\n" + EXPLANATION
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
