#!/usr/bin/env python
"""Which ``traj.ratio_scope``: the spread of sequence IS weights over a step row vs over a whole trajectory.

Workloads: synthetic trajectories of 4, 8, 16, 36 and 100 turns, each turn's loss-token count drawn from the step
rows of ``shared/data/swebench_steps.jsonl`` (median 71, mean 230, max 52K), and the 500 real SWE-bench trajectories
of that file as they are (median 36 turns, 7.9K loss tokens). Each loss token gets an i.i.d. log-ratio
``log pi_train - log pi_rollout ~ N(-s^2/2, s^2)`` (``E[ratio] = 1``) for each per-token mismatch spread ``s``; the
same draws feed every scope. Scopes:

* ``row``: verl's ``compute_rollout_correction_and_rejection_mask`` on the step rows (``traj.ratio_scope=row``);
* ``trajectory``: ``verl_traj.stepwise.ratios.trajectory_rollout_correction`` (verl's function on each trajectory's
  :class:`~verl_traj.stepwise.timeline.Timeline`, ``traj.ratio_scope=trajectory``);
* ``trajectory-geo``: the length-normalised trajectory weight ``exp(mean log-ratio over its loss tokens)`` (GSPO's
  normalisation, the statistic of verl's ``seq_mean_k1``) truncated at the same threshold, from the trajectory
  log-ratio sums the real path returns (its rejections: see below).

IS: verl's defaults when enabled, ``rollout_is=sequence``, ``rollout_is_threshold=2.0`` (truncation). Rejection:
verl's two sequence presets, ``seq_sum_k1`` at ``0.5_2.0`` (``decoupled_seq_is_rs``: reject a sequence whose weight
lies outside [0.5, 2]) and ``seq_mean_k1`` at ``0.999_1.001`` (``decoupled_geo_rs``: the geometric-mean ratio); for
``trajectory-geo`` the first is the geometric weight outside [0.5, 2] (= verl's ``seq_mean_k1`` at ``0.5_2.0`` on
the timeline; the test checks it), the second the trajectory scope's own (the same statistic).

Each workload runs in chunks of at most ``--budget`` padded positions on one torch thread (``--threads``): 20-30 s
for the defaults on two CPU cores, a few seconds with ``--quick``.

Every statistic is over loss tokens (a row's or trajectory's weight counts once per loss token, as verl's
``rollout_corr/rollout_is_eff_sample_size``): ESS = ``(sum w)^2 / (N sum w^2)`` of the truncated weights; min and
median of the truncated weights, max before truncation; the share of tokens whose weight was truncated; the share
of tokens rejected. ``ESS model``: the closed form of ``verl_traj.stepwise.ratio_scope_advice.expected_ess`` on the
same lengths.

    python scripts/bench_ratio_scope.py [--json] [--quick] [--spreads 0.005 0.01 0.02 0.05]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask as verl_correction

from verl_traj.stepwise.ratio_scope_advice import expected_ess
from verl_traj.stepwise.ratios import trajectory_rollout_correction
from verl_traj.stepwise.timeline import Timeline
from verl_traj.testing.swebench import DATA_FILE, load_trajectories

SPREADS = (0.005, 0.01, 0.02, 0.05)
TURNS = (4, 8, 16, 36, 100)
SCOPES = ("row", "trajectory", "trajectory-geo")
IS_THRESHOLD = 2.0  # verl's rollout_is_threshold default
RS_MIS = ("seq_sum_k1", "0.5_2.0")  # verl's RolloutCorrectionConfig.decoupled_seq_is_rs
RS_GEO = ("seq_mean_k1", "0.999_1.001")  # verl's RolloutCorrectionConfig.decoupled_geo_rs
CORRECTION = dict(rollout_is="sequence", rollout_is_threshold=IS_THRESHOLD, rollout_rs=f"{RS_MIS[0]},{RS_GEO[0]}",
                  rollout_rs_threshold=f"{RS_MIS[1]},{RS_GEO[1]}")
BUDGET = 1 << 21  # padded positions per chunk (row layout and timeline)


@dataclass
class Workload:
    """``lengths``: one ``[turns]`` int array of loss tokens per step row, per trajectory."""

    name: str
    lengths: list[np.ndarray]


@dataclass
class Units:
    """One scope's per-unit results over a workload: ``weight`` ``[U]`` truncated IS weights, ``tokens`` ``[U]`` loss
    tokens each, ``raw_max`` the largest weight before truncation, ``rejected`` ``{mode: rejected loss tokens}``."""

    weight: np.ndarray
    tokens: np.ndarray
    raw_max: float
    rejected: dict[str, float]


def load_real(path: Path, limit: Optional[int]) -> list[np.ndarray]:
    """``[turns]`` response-token counts per trajectory of the SWE-bench file (rows without a token dropped)."""
    trajs = load_trajectories(path)[:limit]
    out = [np.asarray(t["steps"], dtype=np.int64).reshape(-1, 2)[:, 1] for t in trajs]
    return [x[x > 0] for x in out if (x > 0).any()]


def synthetic(pool: np.ndarray, turns: int, trajectories: int, rng: np.random.Generator) -> list[np.ndarray]:
    """``trajectories`` arrays of ``turns`` loss-token counts drawn i.i.d. from ``pool`` (the real rows' counts)."""
    return list(rng.choice(pool, size=(trajectories, turns), replace=True))


def chunk_trajectories(lengths: list[np.ndarray], budget: int = BUDGET) -> list[list[int]]:
    """Trajectory indices in groups of similar longest row whose padded row layout ``[rows, longest row]`` and
    timeline ``[trajectories, longest trajectory]`` each stay under ``budget`` positions (a longer one goes alone).
    A one-row "trajectory" per step row gives the row scope's chunks (rows sorted by length)."""
    widths = np.asarray([int(x.max()) for x in lengths])
    totals = np.asarray([int(x.sum()) for x in lengths])
    chunks: list[list[int]] = []
    cur: list[int] = []
    rows = widest = longest = 0
    for i in np.lexsort((totals, widths)).tolist():
        n_rows, width, total = len(lengths[i]), int(widths[i]), int(totals[i])
        r, w, t = rows + n_rows, max(widest, width), max(longest, total)
        if cur and (r * w > budget or (len(cur) + 1) * t > budget):
            chunks.append(cur)
            cur, r, w, t = [], n_rows, width, total
        cur.append(i)
        rows, widest, longest = r, w, t
    return chunks + ([cur] if cur else [])


def ranges(offsets: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``[sum counts]`` int64: ``offsets[0] + arange(counts[0])``, then ``offsets[1] + ...``, concatenated."""
    starts = torch.cumsum(counts, 0) - counts
    return torch.repeat_interleave(offsets - starts, counts) + torch.arange(int(counts.sum()))


def row_batch(lengths: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step rows of these trajectories: ``traj`` ``[B]``, ``step`` ``[B]``, ``response_mask`` ``[B, R]`` (float32,
    each row's loss tokens left-aligned, ``R`` the longest row)."""
    counts = torch.as_tensor(np.concatenate(lengths))
    turns = torch.as_tensor([len(x) for x in lengths])
    traj = torch.repeat_interleave(torch.arange(len(lengths)), turns)
    step = torch.arange(len(counts)) - torch.repeat_interleave(torch.cumsum(turns, 0) - turns, turns)
    mask = (torch.arange(int(counts.max()))[None, :] < counts[:, None]).float()
    return traj, step, mask


def place(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[B, R]`` with ``values`` ``[mask.sum()]`` on the loss tokens in row-major order, 0 elsewhere."""
    out = torch.zeros_like(mask)
    out[mask != 0] = values
    return out


def _rejected(metrics: dict[str, float], tokens: float, mis_option: str = RS_MIS[0]) -> dict[str, float]:
    """Rejected loss tokens per preset from verl's per-option token fractions (``rollout_rs_<opt>_masked_fraction``)."""
    out = {}
    for name, option in (("seq_is_rs", mis_option), ("geo_rs", RS_GEO[0])):
        out[name] = metrics[f"rollout_corr/rollout_rs_{option}_masked_fraction"] * tokens
    return out


def row_scope(old: torch.Tensor, mask: torch.Tensor) -> Units:
    """verl's correction on the step rows (``old``, ``mask`` ``[B, R]``; rollout log-probs 0): one unit per row."""
    weights, _, metrics = verl_correction(old, torch.zeros_like(old), mask, **CORRECTION)
    tokens = mask.sum(-1)
    weight = weights.batch["rollout_is_weights"].sum(-1) / tokens  # a row's tokens share its weight
    return Units(weight.double().numpy(), tokens.double().numpy(), metrics["rollout_corr/rollout_is_max"],
                 _rejected(metrics, float(tokens.sum())))


def trajectory_scopes(old: torch.Tensor, mask: torch.Tensor, traj: torch.Tensor, step: torch.Tensor
                      ) -> tuple[Units, Units]:
    """``(trajectory, trajectory-geo)`` units. Trajectory: verl_traj's ``trajectory_rollout_correction`` on the rows'
    timeline, each row carrying its trajectory's weight back (units: rows, token-weighted = per trajectory).
    Geo: ``g = exp(log_ratio_sum / tokens)`` per trajectory ``[T]`` from the same call, truncated at the IS threshold;
    rejected: ``g`` outside [0.5, 2] (= verl's ``seq_mean_k1`` at ``0.5_2.0`` on the timeline; the test checks it)
    and verl's ``seq_mean_k1`` at ``0.999_1.001`` (the same statistic: the trajectory scope's)."""
    timeline = Timeline.build(traj, step, mask)
    got = trajectory_rollout_correction(verl_correction, timeline, old, torch.zeros_like(old), mask, **CORRECTION)
    tokens = mask.sum(-1)
    weight = got.weights.sum(-1) / tokens
    whole = Units(weight.double().numpy(), tokens.double().numpy(), got.metrics["rollout_corr/rollout_is_max"],
                  _rejected(got.metrics, float(tokens.sum())))
    traj_tokens = timeline.mask(old).sum(-1).double()
    geo = torch.exp(got.log_ratio_sum.double() / traj_tokens)
    low, high = (float(x) for x in RS_MIS[1].split("_"))
    rejected = {"seq_is_rs": float(traj_tokens[(geo < low) | (geo > high)].sum()), "geo_rs": whole.rejected["geo_rs"]}
    return whole, Units(geo.clamp(max=IS_THRESHOLD).numpy(), traj_tokens.numpy(), float(geo.max()), rejected)


def merge(parts: list[Units]) -> Units:
    """The units of several chunks as one."""
    return Units(np.concatenate([p.weight for p in parts]), np.concatenate([p.tokens for p in parts]),
                 max(p.raw_max for p in parts), {k: sum(p.rejected[k] for p in parts) for k in parts[0].rejected})


def summarise(units: Units) -> dict[str, float]:
    """Token-weighted statistics of ``units``: ESS ``(sum n w)^2 / (N sum n w^2)``, min / median of the truncated
    weights, max before truncation, truncated and rejected token shares."""
    n, w = units.tokens, units.weight
    total = float(n.sum())
    order = np.argsort(w, kind="stable")
    cum = np.cumsum(n[order])
    median = float(w[order][np.searchsorted(cum, 0.5 * cum[-1])])
    truncated = float(n[w >= IS_THRESHOLD * (1 - 1e-6)].sum() / total)
    return {"ess": float((n @ w) ** 2 / (total * (n @ (w * w)))), "w_min": float(w.min()), "w_median": median,
            "w_max_raw": float(units.raw_max), "truncated_share": truncated,
            "rejected_seq_is_rs": units.rejected["seq_is_rs"] / total,
            "rejected_geo_rs": units.rejected["geo_rs"] / total}


def run_workload(lengths: list[np.ndarray], spread: float, gen: torch.Generator, budget: int = BUDGET
                 ) -> dict[str, Units]:
    """Every scope on one workload at one spread. One i.i.d. ``N(-s^2/2, s^2)`` log-ratio per loss token (``[N]``,
    trajectory by trajectory, rows in step order) feeds every scope, as ``old_log_prob`` against a zero
    ``rollout_log_prob``: row scope on the step rows sorted by length (no cross-row effect), trajectory scopes on
    whole trajectories' step rows, chunk by chunk."""
    counts = torch.as_tensor(np.concatenate(lengths))
    turns = torch.as_tensor([len(x) for x in lengths])
    row_offset, first_row = torch.cumsum(counts, 0) - counts, torch.cumsum(turns, 0) - turns
    noise = torch.randn(int(counts.sum()), generator=gen) * spread - 0.5 * spread * spread
    parts: dict[str, list[Units]] = {scope: [] for scope in SCOPES}
    for idx in chunk_trajectories([c.reshape(1) for c in counts.numpy()], budget):
        rows = torch.as_tensor(idx)
        _, _, mask = row_batch([counts[rows].numpy()])
        parts["row"].append(row_scope(place(mask, noise[ranges(row_offset[rows], counts[rows])]), mask))
    for idx in chunk_trajectories(lengths, budget):
        rows = ranges(first_row[idx], turns[idx])
        traj, step, mask = row_batch([lengths[i] for i in idx])
        old = place(mask, noise[ranges(row_offset[rows], counts[rows])])
        whole, geo = trajectory_scopes(old, mask, traj, step)
        parts["trajectory"].append(whole)
        parts["trajectory-geo"].append(geo)
    return {scope: merge(p) for scope, p in parts.items()}


def build_workloads(data: Path, turns: tuple[int, ...], trajectories: int, real_limit: Optional[int], seed: int
                    ) -> list[Workload]:
    """Synthetic ``<k>-turn`` workloads (turn lengths drawn from the real rows) and ``swebench`` (the real ones)."""
    real = load_real(data, real_limit)
    pool = np.concatenate(load_real(data, None))
    out = [Workload(f"{k}-turn", synthetic(pool, k, trajectories, np.random.default_rng(seed + k))) for k in turns]
    return out + [Workload("swebench", real)]


def measure(workloads: list[Workload], spreads: tuple[float, ...], seed: int, budget: int = BUDGET
            ) -> list[dict[str, Any]]:
    """One record per workload x spread x scope (see the module docstring for the columns)."""
    records = []
    for wi, wl in enumerate(workloads):
        traj_tokens = [float(x.sum()) for x in wl.lengths]
        row_tokens = np.concatenate(wl.lengths).astype(float).tolist()
        for si, s in enumerate(spreads):
            gen = torch.Generator().manual_seed(seed * 100_003 + 1_000 * wi + si)
            units = run_workload(wl.lengths, s, gen, budget)
            model = {"row": expected_ess(row_tokens, s), "trajectory": expected_ess(traj_tokens, s),
                     "trajectory-geo": None}
            for scope in SCOPES:
                records.append({"workload": wl.name, "trajectories": len(wl.lengths), "rows": len(row_tokens),
                                "turns_median": float(np.median([len(x) for x in wl.lengths])),
                                "loss_tokens_per_trajectory_median": float(np.median(traj_tokens)),
                                "spread": s, "scope": scope, "ess_model": model[scope], **summarise(units[scope])})
    return records


def _weight(x: float) -> str:
    """A weight for the table: 4 decimals, or 2 significant digits below 0.01."""
    return f"{x:.4f}" if 0.01 <= x < 100 else f"{x:.1e}"


def format_table(records: list[dict[str, Any]]) -> str:
    """A plain-text table, one line per record (shares in %)."""
    head = (f"{'workload':<10} {'turns':>5} {'tok/traj':>8} {'s':>6} {'scope':<14} {'ESS':>6} {'model':>6} "
            f"{'w min':>8} {'w med':>8} {'w max':>8} {'trunc%':>6} {'rejMIS%':>7} {'rejGeo%':>7}")
    lines = [head, "-" * len(head)]
    for r in records:
        model = "-" if r["ess_model"] is None else f"{r['ess_model']:.3f}"
        lines.append(f"{r['workload']:<10} {r['turns_median']:>5.0f} {r['loss_tokens_per_trajectory_median']:>8.0f} "
                     f"{r['spread']:>6g} {r['scope']:<14} {r['ess']:>6.3f} {model:>6} {_weight(r['w_min']):>8} "
                     f"{_weight(r['w_median']):>8} {_weight(r['w_max_raw']):>8} {100 * r['truncated_share']:>6.1f} "
                     f"{100 * r['rejected_seq_is_rs']:>7.1f} {100 * r['rejected_geo_rs']:>7.1f}")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command line; ``--quick`` = 16 synthetic trajectories per length, the first 32 real ones."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DATA_FILE, help="swebench_steps.jsonl")
    p.add_argument("--spreads", type=float, nargs="+", default=list(SPREADS), help="per-token log-ratio std s")
    p.add_argument("--turns", type=int, nargs="+", default=list(TURNS), help="synthetic trajectory lengths")
    p.add_argument("--trajectories", type=int, default=128, help="synthetic trajectories per length")
    p.add_argument("--real-limit", type=int, default=None, help="use the first N real trajectories (default all)")
    p.add_argument("--budget", type=int, default=BUDGET, help="padded positions per chunk")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: the chunks are small, and a shared CPU makes more threads spin)")
    p.add_argument("--quick", action="store_true", help="small sizes (tests)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = p.parse_args(argv)
    if args.quick:
        args.trajectories, args.real_limit = min(args.trajectories, 16), min(args.real_limit or 32, 32)
    return args


def run(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Parse ``argv``, measure, return ``{"config": ..., "records": [...], "seconds": ...}``."""
    args = parse_args(argv)
    start, threads = time.perf_counter(), torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        workloads = build_workloads(args.data, tuple(args.turns), args.trajectories, args.real_limit, args.seed)
        records = measure(workloads, tuple(args.spreads), args.seed, args.budget)
    finally:
        torch.set_num_threads(threads)
    config = {"data": str(args.data), "spreads": args.spreads, "turns": args.turns,
              "synthetic_trajectories": args.trajectories, "real_limit": args.real_limit, "seed": args.seed,
              "rollout_is": "sequence", "rollout_is_threshold": IS_THRESHOLD, "rejection_seq_is_rs": list(RS_MIS),
              "rejection_geo_rs": list(RS_GEO), "statistics": "over loss tokens (each weight counted per token)",
              "noise": "i.i.d. per loss token, log-ratio ~ N(-s^2/2, s^2)"}
    return {"config": config, "records": records, "seconds": time.perf_counter() - start}


def main(argv: Optional[list[str]] = None) -> int:
    """Print the table (or ``--json``)."""
    result = run(argv)
    if parse_args(argv).json:
        print(json.dumps(result, indent=1))
    else:
        print(format_table(result["records"]))
        print(f"\n{len(result['records'])} rows in {result['seconds']:.1f} s; statistics over loss tokens; "
              f"IS rollout_is=sequence truncated at {IS_THRESHOLD}; rejection: MIS = {RS_MIS[0]} {RS_MIS[1]} "
              f"(traj-geo: seq_mean_k1 {RS_MIS[1]}), Geo = {RS_GEO[0]} {RS_GEO[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
