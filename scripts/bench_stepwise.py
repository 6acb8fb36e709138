#!/usr/bin/env python
"""Step-wise vs prefix-merged training rows on real multi-turn lengths (SWE-bench agent trajectories).

Input: ../shared/data/swebench_steps.jsonl beside the repository (per-step [prompt_tokens, response_tokens], no text).
Token ids are synthesised per trajectory so that the MERGE FUNCTION ITSELF decides every boundary:

* step i+1's prompt = step i's prompt + response + fresh observation tokens, when the recorded
  prompt grows by at least prompt_i + response_i (the conversation is append-only);
* otherwise (context rewritten / truncated) step i+1's prompt keeps the first min(P_0, P_{i+1})
  tokens (system prompt + task) and continues with fresh tokens, so it is not a continuation;
* ``--retokenise-prob p`` additionally re-tokenises the last token of step i's response inside
  step i+1's prompt with probability p (a tokenizer that does not round-trip): no merge there.

Trajectories are processed one at a time (the step-wise layout alone is ~283M token ids).

Planned update time: the slowest DP rank's workload summed over mini-batches (what a synchronous
optimizer step waits for), from ``verl_traj.core.plan_mini_batches`` when it is importable, else from
a workload model (verl's ``calculate_workload`` = 24576*L + L^2 per row, rows dealt greedily to the
lightest rank); the output names which. Group ids: ``--group-size`` consecutive trajectories share
a synthetic uid (GRPO group), or ``--group-by repo`` groups consecutive trajectories of one repo.

    python scripts/bench_stepwise.py [--json] [--dp 8] [--mini-batches 4] [--group-size 4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np
import torch

from verl_traj.stepwise.prefix_merge import MergeStats, merge_trajectory_steps

from verl_traj.testing.swebench import DATA_FILE, load_trajectories

DEFAULT_DATA = str(DATA_FILE)


def synthesise_trajectory(steps: list[list[int]], gen: torch.Generator, retokenise_prob: float, vocab: int = 150000):
    """Token ids for one trajectory's steps (lists of 1-D int32 tensors)."""
    prompts: list[torch.Tensor] = []
    responses: list[torch.Tensor] = []
    rand = lambda n: torch.randint(0, vocab, (int(n),), generator=gen, dtype=torch.int32)  # noqa: E731
    p0 = int(steps[0][0])
    for i, (p, r) in enumerate(steps):
        p, r = int(p), int(r)
        if i == 0:
            prompt = rand(p)
        else:
            prev_full = prompts[-1].numel() + responses[-1].numel()
            if p >= prev_full:
                parts = [prompts[-1], responses[-1], rand(p - prev_full)]
                if retokenise_prob > 0 and responses[-1].numel() and float(torch.rand(1, generator=gen)) < retokenise_prob:
                    # the previous response's last token comes back as a different token
                    parts[1] = torch.cat([responses[-1][:-1], (responses[-1][-1:] + 1) % vocab])
                prompt = torch.cat(parts)
            else:
                keep = min(p0, p)
                prompt = torch.cat([prompts[0][:keep], rand(p - keep)])
        prompts.append(prompt)
        responses.append(rand(r))
    return prompts, responses


def load(path: str) -> list[dict[str, Any]]:
    return load_trajectories(path)


def group_ids(trajs: list[dict[str, Any]], group_by: str, group_size: int) -> list[str]:
    if group_by == "repo":
        out, prev, g = [], None, -1
        for t in trajs:
            repo = str(t["id"]).split("__")[0]
            if repo != prev:
                g, prev = g + 1, repo
            out.append(f"repo{g}:{repo}")
        return out
    return [f"g{k // group_size}" for k in range(len(trajs))]


def plan_time(rows_tokens, rows_loss, rows_uid, rows_traj, rows_step, rows_last, dp: int, mini_batches: int, seed: int,
              planner: str = "auto"):
    """Slowest-rank workload summed over mini-batches; returns (value, method, extra)."""
    try:
        if planner == "model":
            raise ImportError("--planner model")
        from verl_traj.core.layout import build_layout_from_counts
        from verl_traj.core.planning import plan_mini_batches
    except Exception as exc:  # planner not landed yet (or forced off)
        method = (f"workload model (verl calculate_workload, groups LPT over mini-batches, rows greedy over {dp} ranks; "
                  f"core planner not used: {exc})")
        return _model_time(rows_tokens, rows_uid, dp, mini_batches), method, {}
    layout = build_layout_from_counts(
        np.asarray(rows_tokens, dtype=np.int64),
        np.asarray(rows_loss, dtype=np.int64),
        np.asarray(rows_uid, dtype=object),
        np.asarray(rows_traj, dtype=object),
        np.asarray(rows_step, dtype=np.int64),
        np.asarray(rows_last, dtype=bool),
    )
    t0 = time.perf_counter()
    plan = plan_mini_batches(layout, mini_batches, dp, group_by="group", balance_dp=True, workload="verl", seed=seed)
    dt = time.perf_counter() - t0
    s = plan.stats
    extra = {
        "plan_seconds": dt,
        "padding_rows": int(s.padding_rows.sum()),
        "balance_ratio_worst": float((s.max_rank_workload.double() / s.workload_lower_bound.double().clamp(min=1)).max()),
        "optimizer_steps": int(plan.num_mini_batches),
    }
    return int(s.max_rank_workload.sum()), f"verl_traj.core.plan_mini_batches (dp={dp}, workload=verl, group_by=group)", extra


def _model_time(tokens, uid, dp, mini_batches):
    tokens = np.asarray(tokens, dtype=np.int64)
    w = 24576 * tokens + tokens * tokens
    _, g = np.unique(np.asarray(uid, dtype=object).astype(str), return_inverse=True)
    G = int(g.max()) + 1
    gw = np.bincount(g, weights=w, minlength=G)
    mb_of_g = np.zeros(G, dtype=np.int64)
    load = np.zeros(mini_batches)
    for k in np.argsort(-gw, kind="stable"):
        m = int(np.argmin(load))
        mb_of_g[k] = m
        load[m] += gw[k]
    total = 0
    mb = mb_of_g[g]
    for m in range(mini_batches):
        ranks = np.zeros(dp, dtype=np.int64)
        for i in np.argsort(-w[mb == m], kind="stable"):
            ranks[int(np.argmin(ranks))] += int(w[mb == m][i])
        total += int(ranks.max())
    return total


def expand_timing(trajs: list[dict[str, Any]], uids: list[str], seed: int) -> dict[str, Any]:
    """Driver-side cost of ``expand_step_rows`` on one rollout batch of these trajectories: the
    concatenated rows (verl's layout) + delta-encoded per-call records, as the step-wise agent loop
    produces them; merged and step-wise."""
    from verl_traj.stepwise.expand import encode_step_records, expand_step_rows

    gen = torch.Generator().manual_seed(seed)
    recs, rows = [], []
    for t in trajs:
        p, r = synthesise_trajectory(t["steps"], gen, 0.0)
        recs.append(encode_step_records([{"prompt_ids": a.numpy(), "response_ids": b.numpy()} for a, b in zip(p, r)]))
        p0 = p[0].numel()
        full = torch.cat([p[-1], r[-1]]).long()
        mask = torch.zeros(full.numel() - p0, dtype=torch.long)
        for a, b in zip(p, r):
            mask[a.numel() - p0 : a.numel() - p0 + b.numel()] = 1
        rows.append((p[0].long(), full[p0:], mask))
        del p, r
    B = len(rows)
    P = max(x[0].numel() for x in rows)
    R = max(x[1].numel() for x in rows)
    tensors = {
        "prompts": torch.zeros(B, P, dtype=torch.long),
        "responses": torch.zeros(B, R, dtype=torch.long),
        "response_mask": torch.zeros(B, R, dtype=torch.long),
        "attention_mask": torch.zeros(B, P + R, dtype=torch.long),
        "rm_scores": torch.zeros(B, R),
    }
    for b, (p, r, m) in enumerate(rows):
        tensors["prompts"][b, P - p.numel():] = p
        tensors["responses"][b, : r.numel()] = r
        tensors["response_mask"][b, : r.numel()] = m
        tensors["attention_mask"][b, P - p.numel(): P + r.numel()] = 1
        tensors["rm_scores"][b, r.numel() - 1] = 1.0
    col = np.empty(B, dtype=object)
    col[:] = recs
    non = {"uid": np.asarray(uids[:B], dtype=object), "traj_steps": col}
    out: dict[str, Any] = {"trajectories": B}
    for merge in (True, False):
        t0 = time.perf_counter()
        res = expand_step_rows(tensors, non, merge_prefix=merge)
        dt = time.perf_counter() - t0
        key = "merged" if merge else "stepwise"
        out[f"{key}_seconds"] = round(dt, 3)
        out[f"{key}_shape"] = list(res.tensors["input_ids"].shape)
        out[f"{key}_padded_bytes"] = int(sum(v.numel() * v.element_size() for v in res.tensors.values()))
        del res
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--limit", type=int, default=None, help="first N trajectories only")
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--mini-batches", type=int, default=4)
    ap.add_argument("--group-by", choices=["synthetic", "repo"], default="synthetic")
    ap.add_argument("--group-size", type=int, default=4, help="trajectories per synthetic GRPO group")
    ap.add_argument("--retokenise-prob", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--planner", choices=["auto", "model"], default="auto",
                    help="auto: verl_traj.core.plan_mini_batches if importable, else the workload model")
    ap.add_argument("--expand-trajectories", type=int, default=0,
                    help="also time expand_step_rows on one rollout batch of the first N trajectories")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args(argv)

    trajs = load(args.data)[: args.limit]
    uids = group_ids(trajs, args.group_by, args.group_size)
    gen = torch.Generator().manual_seed(args.seed)

    total = MergeStats()
    step_rows = {k: [] for k in ("tokens", "loss", "uid", "traj", "step", "last")}
    merged_rows = {k: [] for k in ("tokens", "loss", "uid", "traj", "step", "last")}
    max_len_step = max_len_merged = 0
    t_synth = t_merge = 0.0
    for k, (t, uid) in enumerate(zip(trajs, uids)):
        steps = t["steps"]
        if not steps:
            continue
        t0 = time.perf_counter()
        prompts, responses = synthesise_trajectory(steps, gen, args.retokenise_prob)
        t1 = time.perf_counter()
        rows, st = merge_trajectory_steps(prompts, responses)
        t2 = time.perf_counter()
        t_synth += t1 - t0
        t_merge += t2 - t1
        total = total + st
        n = len(steps)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            step_rows["tokens"].append(p.numel() + r.numel())
            step_rows["loss"].append(r.numel())
        step_rows["uid"] += [uid] * n
        step_rows["traj"] += [k] * n
        step_rows["step"] += list(range(n))
        step_rows["last"] += [False] * (n - 1) + [True]
        for row in rows:
            merged_rows["tokens"].append(row.num_tokens)
            merged_rows["loss"].append(int(torch.count_nonzero(row.response_mask)))
            merged_rows["uid"].append(uid)
            merged_rows["traj"].append(k)
            merged_rows["step"].append(row.step_index)
            merged_rows["last"].append(row.is_last_step)
        max_len_step = max(max_len_step, max(step_rows["tokens"][-n:]))
        max_len_merged = max(max_len_merged, max(r.num_tokens for r in rows))
        del prompts, responses, rows

    assert total.loss_tokens_before == total.loss_tokens_after, "loss tokens changed by merging"
    assert sum(step_rows["loss"]) == sum(merged_rows["loss"]) == total.loss_tokens_after

    res_step = plan_time(*(step_rows[k] for k in ("tokens", "loss", "uid", "traj", "step", "last")),
                         args.dp, args.mini_batches, args.seed, args.planner)
    res_merged = plan_time(*(merged_rows[k] for k in ("tokens", "loss", "uid", "traj", "step", "last")),
                           args.dp, args.mini_batches, args.seed, args.planner)
    out = {
        "data": os.path.basename(args.data),
        "trajectories": len(trajs),
        "groups": f"{args.group_by}" + (f" (uid = {args.group_size} consecutive trajectories)" if args.group_by == "synthetic" else " (consecutive trajectories of one repo)"),
        "retokenise_prob": args.retokenise_prob,
        "rows_stepwise": total.rows_before,
        "rows_merged": total.rows_after,
        "tokens_stepwise": total.tokens_before,
        "tokens_merged": total.tokens_after,
        "token_ratio": total.token_ratio,
        "loss_tokens_stepwise": total.loss_tokens_before,
        "loss_tokens_merged": total.loss_tokens_after,
        "loss_tokens_identical": total.loss_tokens_before == total.loss_tokens_after,
        "max_row_tokens_stepwise": max_len_step,
        "max_row_tokens_merged": max_len_merged,
        "planned_update_workload_stepwise": res_step[0],
        "planned_update_workload_merged": res_merged[0],
        "planned_update_speedup": res_step[0] / max(res_merged[0], 1),
        "planner": res_step[1],
        "dp": args.dp,
        "mini_batches": args.mini_batches,
        "plan_extra_stepwise": res_step[2],
        "plan_extra_merged": res_merged[2],
        "seconds_synthesise": round(t_synth, 2),
        "seconds_merge": round(t_merge, 2),
        "merge_tokens_per_second": total.tokens_before / max(t_merge, 1e-9),
    }
    if args.expand_trajectories:
        out["expand_step_rows"] = expand_timing(trajs[: args.expand_trajectories], uids, args.seed)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"data: {out['data']}  trajectories: {out['trajectories']}  groups: {out['groups']}  "
          f"retokenise_prob: {args.retokenise_prob}")
    print(f"planner: {out['planner']}  mini-batches: {args.mini_batches}")
    print()
    w = 30
    print(f"{'':{w}} {'step-wise':>16} {'merged':>16} {'ratio':>8}")
    def line(name, a, b):
        print(f"{name:{w}} {a:>16,} {b:>16,} {a / max(b, 1):>8.2f}x")
    line("rows", out["rows_stepwise"], out["rows_merged"])
    line("training tokens", out["tokens_stepwise"], out["tokens_merged"])
    line("loss tokens", out["loss_tokens_stepwise"], out["loss_tokens_merged"])
    line("longest row (tokens)", max_len_step, max_len_merged)
    line("planned update workload", out["planned_update_workload_stepwise"], out["planned_update_workload_merged"])
    print()
    print(f"loss tokens identical: {out['loss_tokens_identical']}; merge time {t_merge:.1f}s "
          f"({out['merge_tokens_per_second'] / 1e6:.0f}M step tokens/s), synthesis {t_synth:.1f}s")
    if args.expand_trajectories:
        e = out["expand_step_rows"]
        print(f"expand_step_rows on one batch of {e['trajectories']} trajectories: merged {e['merged_seconds']:.2f}s "
              f"-> {e['merged_shape']} ({e['merged_padded_bytes'] / 2**30:.2f} GiB padded tensors); step-wise "
              f"{e['stepwise_seconds']:.2f}s -> {e['stepwise_shape']} ({e['stepwise_padded_bytes'] / 2**30:.2f} GiB)")
    print("planned update workload = sum over mini-batches of the slowest rank's sum of 24576*L + L^2 (verl's "
          "calculate_workload; relative units, lower is faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
