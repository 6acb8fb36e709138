#!/usr/bin/env python
"""Length bias against throughput of every staleness and failure policy, in each v1 trainer mode (issue 43).

An agent whose long trajectories are the ones that succeed (reward probability 0.1 + 0.8 x the trajectory's turn-count
percentile) and take longest to generate. Two workloads, the range users run:

* ``swebench``: each prompt one of the 500 real SWE-bench trajectories in ``shared/data/swebench_steps.jsonl``
  (22-145 LLM calls, 3.7k-71k generated tokens); each of its ``n`` sessions scales the call count and each call's
  tokens by a log-normal draw (sigma 0.35 and 0.2), the trained context with it;
* ``calc``: the calculator agent's shape, problems of 1-12 operations, one call per operation and one to answer,
  40-160 tokens a call.

The replay buffer and its policies are verl_traj's and verl's own classes; the clock is modelled
(``scripts/async_sim.py``: rollout pool, tool calls, update time). Per run, over the steady steps (after the first
third):

* ``s/step``, ``traj/h`` (trajectories trained per hour), ``trainer waits`` (its share of wall time blocked in
  ``sample``);
* ``tokens ratio``: the mean length of what trained over the mean length of every trajectory the agent was asked for
  (the truth the simulation knows, whatever was cut);
* ``reward ratio``: the mean reward of what trained over the mean reward of all (what the policy gradient sees);
* ``lag max`` / ``lag p99`` (versions between a trained token's policy and the trained one), ``dropped`` (groups
  dropped for staleness or failure), ``corrected`` (share of trained groups over the bound, under ``correct``);
* the trained tokens' importance weights under synthetic drift (``--drifts``: ``scripts/async_drift.py``): ``ESS
  min`` / ``ESS p5`` (untruncated), ``ESS trunc min`` and ``M2 max`` (the gate's two statistics), ``healthy or
  fallback`` (share of steps whose weights pass the gate's thresholds or whose batch was sampled in fallback),
  ``seq ESS p50`` (one weight per trajectory: what ``rollout_is=sequence`` would weigh), ``trunc share`` / ``trunc
  mass``, ``fallback`` (share of steps the gate was open);
* ``tokens trained`` (of the cohort's generated tokens), ``bias lower`` / ``bias upper`` (the logged bracket,
  pooled over the steady steps).

Policies: none, verl's drop (8 versions) and wait (2), ``traj.stale_groups`` drop and defer at 1.0, and ``correct``
at 1.0 with each ``--caps`` value (``traj.max_lag``) and each fallback.

    python scripts/bench_async_bias.py [--workload swebench|calc|both] [--caps 8] [--drifts 1e-3 1e-2 5e-2] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Optional
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from async_sim import Knobs, Simulation  # noqa: E402

from verl_traj.config import DEFAULT_MAX_LAG, TrajConfig  # noqa: E402
from verl_traj.core.rollout.length_bias import LengthBudget, pooled_bias  # noqa: E402
from verl_traj.core.rollout.offpolicy import gate_statistics  # noqa: E402
from verl_traj.testing.swebench import DATA_FILE, load_trajectories  # noqa: E402



@dataclass
class Workload:
    """Prompts as lists of calls: ``calls[i]`` the tokens of prompt ``i``'s calls, ``context[i]`` its final context."""

    name: str
    calls: list
    context: np.ndarray
    scale_sigma: float
    knobs: Knobs

    def __post_init__(self) -> None:
        self.turn_cdf = np.sort(np.array([len(c) for c in self.calls], dtype=float))
        # the agent's hard budget (max turns x max tokens a call), which no session passes: the bracket's lower end
        self.max_turns = int(2 * max(len(c) for c in self.calls))
        self.max_call_tokens = float(2 * max(max(c) for c in self.calls))
        self.budget = LengthBudget(tokens=self.max_turns * self.max_call_tokens, turns=float(self.max_turns))

    def group(self, rng: np.random.Generator, n: int) -> list:
        i = int(rng.integers(len(self.calls)))
        base = np.asarray(self.calls[i], dtype=float)
        out = []
        for _ in range(n):
            turns = min(self.max_turns, max(1, int(round(len(base) * rng.lognormal(0.0, self.scale_sigma)))))
            tokens = np.clip(np.resize(base, turns) * rng.lognormal(0.0, 0.2, turns), 1.0, self.max_call_tokens).round()
            rank = np.searchsorted(self.turn_cdf, turns, side="right") / len(self.turn_cdf)
            reward = float(rng.random() < 0.1 + 0.8 * min(rank, 1.0))
            out.append((tokens, float(self.context[i]) * turns / len(base), reward))
        return out


def swebench() -> Workload:
    if not DATA_FILE.exists():
        raise SystemExit(f"{DATA_FILE} is missing: the SWE-bench lengths sit in shared/data beside the checkout. Fix: "
                         "point VERL_TRAJ_SWEBENCH at swebench_steps.jsonl, or run --workload calc")
    rows = load_trajectories(DATA_FILE)
    calls = [[resp for _, resp in r["steps"]] for r in rows]
    context = np.array([r["steps"][-1][0] + r["steps"][-1][1] for r in rows], dtype=float)
    return Workload("swebench", calls, context, 0.35,
                    Knobs(decode_tps=30.0, capacity=192, tool_s=2.0, train_tps=10000.0, train_fixed_s=10.0, dt=1.0))


def calc(seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    ops = rng.integers(1, 13, 500)
    calls = [list(rng.integers(40, 161, k + 1)) for k in ops]
    context = np.array([300 + sum(c) + 30 * len(c) for c in calls], dtype=float)
    return Workload("calc", calls, context, 0.15,
                    Knobs(decode_tps=30.0, capacity=192, tool_s=0.2, train_tps=10000.0, train_fixed_s=2.0, dt=0.25))


# name -> (traj: overrides, verl's max_off_policy_threshold, verl's strategy); "traj correct" rows are added per cap
STALENESS = {
    "none": ({}, None, "drop"),
    "verl default (drop, 8 versions)": ({}, 8, "drop"),
    "verl wait (2 versions)": ({}, 2, "wait"),
    "traj drop (1.0)": ({"max_staleness": 1.0}, None, "drop"),
    "traj defer (1.0)": ({"max_staleness": 1.0, "stale_groups": "defer"}, None, "drop"),
}
FAILURES = {
    "drop": {"failed_groups": "drop"},
    "keep_survivors": {"failed_groups": "keep_survivors"},
}
MODES = ("sync", "colocate_async", "separate_async")


def policies(caps: list[int]) -> dict:
    """Every staleness policy of the table: :data:`STALENESS` and ``traj correct`` at each cap, with each fallback."""
    out = dict(STALENESS)
    for cap in caps:
        for fallback in ("defer", "drop"):
            out[f"traj correct (1.0, lag {cap}, {fallback})"] = (
                {"max_staleness": 1.0, "stale_groups": "correct", "max_lag": cap, "correct_fallback": fallback},
                None, "drop")
    return out


def run(workload: Workload, mode: str, staleness: str, failures: str, args, fail_per_call: float = 0.0,
        drift: Optional[float] = None) -> dict:
    traj_kw, threshold, strategy = policies(args.caps)[staleness]
    if mode == "sync":
        traj_kw, threshold = {}, None
    traj = TrajConfig(**traj_kw, **FAILURES[failures])
    knobs = Knobs(**{**workload.knobs.__dict__, "fail_per_call": fail_per_call,
                     "timeout_s": getattr(args, "timeout_s", None) if fail_per_call else None})
    sim = Simulation(mode, traj, workload, knobs, args.batch, args.n, args.seed, verl_threshold=threshold,
                     verl_strategy=strategy, drift=drift)
    steps = [sim.run_step() for _ in range(args.steps)]
    return summarise(sim, steps[args.steps // 4:], (args.steps // 4, args.steps // 2))


def _steady(steady: list, key: str, default: float = 0.0) -> np.ndarray:
    return np.array([s["metrics"].get(key, default) for s in steady], dtype=float)


def summarise(sim: Simulation, steady: list, cohort: tuple[int, int]) -> dict:
    """The run's figures (module docstring): time over the ``steady`` steps, bias over the ``cohort`` of groups
    dispatched in steps ``(cohort[0], cohort[1]]``, trained whenever (the run goes on long enough for them); the
    logged bracket pooled over the steady steps (:func:`~verl_traj.core.rollout.length_bias.pooled_bias`)."""
    wall = sum(s["step_s"] for s in steady)
    group = [x for x in sim.dispatched if cohort[0] < x.dispatch_step <= cohort[1]]
    trained = [x for x in group if f"{x.uid}_{x.sid}_0" in sim.trained]
    if not trained:
        raise SystemExit(f"no trajectory of the cohort trained in {sim.mode}; run more --steps")

    def ratio(measure) -> float:
        return float(np.mean([measure(x) for x in trained]) / np.mean([measure(x) for x in group]))

    pooled = pooled_bias([s["metrics"] for s in steady])
    ess = _steady(steady, "traj_offpolicy/ess", 1.0)
    # a step is fine where its weights are healthy by the gate's statistics, or its batch was sampled in fallback
    gated = [not sim.buffer.health_thresholds.unhealthy(*gate_statistics(s["metrics"]))
             or bool(s["metrics"].get("traj_offpolicy/sampled_in_fallback", 0.0)) for s in steady]
    dropped = sum(s["metrics"].get("training/off_policy/evicted_samples", 0.0)  # traj's drops among them
                  + s["metrics"].get("traj_failure/groups_dropped_total", 0.0) for s in steady)
    return {"s/step": statistics.median(s["step_s"] for s in steady),
            "traj/h": sum(s["trained"] for s in steady) / wall * 3600,
            "trainer waits": sum(s["wait_s"] for s in steady) / wall,
            "lag max": float(_steady(steady, "traj_offpolicy/lag_max").max()),
            "lag p99": float(_steady(steady, "traj_offpolicy/lag_p99").max()),
            "ESS min": float(ess.min()), "ESS p5": float(np.percentile(ess, 5)),
            "ESS trunc min": float(_steady(steady, "traj_offpolicy/ess_truncated", 1.0).min()),
            "M2 max": float(_steady(steady, "traj_offpolicy/log_ratio_m2").max()),
            "healthy or fallback": float(np.mean(gated)),
            "seq ESS p50": float(np.median(_steady(steady, "traj_offpolicy/seq_ess", 1.0))),
            "trunc share": float(_steady(steady, "traj_offpolicy/truncated_share").mean()),
            "trunc mass": float(_steady(steady, "traj_offpolicy/truncated_mass").mean()),
            "tokens trained": sum(x.tokens.sum() for x in trained) / sum(x.tokens.sum() for x in group),
            "tokens ratio": ratio(lambda x: x.tokens.sum()), "turns ratio": ratio(lambda x: len(x.tokens)),
            "bias lower": pooled.get("tokens_mean_ratio_lower", float("nan")),
            "bias upper": pooled.get("tokens_mean_ratio", 1.0),
            "reward ratio": ratio(lambda x: x.reward),
            "fallback": float(_steady(steady, "traj_offpolicy/fallback_active").mean()),
            "dropped": dropped,
            "corrected": sum(s["metrics"].get("traj_staleness/groups_corrected_total", 0.0) for s in steady)
            / max(1.0, sum(s["trained"] for s in steady) / sim.n),
            "cohort": len(group), "untrained": len(group) - len(trained)}


COLUMNS = ("s/step", "traj/h", "trainer waits", "lag max", "lag p99", "ESS min", "ESS p5", "ESS trunc min", "M2 max",
           "healthy or fallback", "seq ESS p50", "trunc share", "trunc mass", "tokens trained", "tokens ratio", "bias lower", "bias upper", "reward ratio",
           "fallback", "dropped", "corrected")
PERCENT = {"trainer waits", "corrected", "fallback", "tokens trained", "healthy or fallback"}
THREE = {"ESS min", "ESS p5", "ESS trunc min", "M2 max", "seq ESS p50", "trunc share", "trunc mass", "tokens ratio", "bias lower", "bias upper",
         "reward ratio", "turns ratio"}


def grid(args) -> list[tuple[str, str, str, float, Optional[float]]]:
    """(mode, staleness policy, failure policy, crash probability per call, drift rate): every staleness policy
    without failures at every drift rate, then every failure policy with crashes (no bound, the first drift rate),
    each in every mode."""
    names = list(policies(args.caps))
    out = [(m, s, "drop", 0.0, d) for d in args.drifts for m in args.modes for s in names if m != "sync" or s == "none"]
    out += [(m, "none", f, args.fail_per_call, args.drifts[0]) for m in args.modes for f in FAILURES]
    return out


def cell(column: str, value: float) -> str:
    if column in PERCENT:
        return f"{value:.1%}" if column == "tokens trained" else f"{value:.0%}"
    if column in ("traj/h", "dropped", "lag max", "lag p99"):
        return f"{value:.0f}"
    return f"{value:.3f}" if column in THREE else f"{value:.2f}"


def table(rows: list[dict]) -> str:
    head = ["workload", "mode", "drift", "staleness", "failures", *COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        cells = [cell(c, r[c]) for c in COLUMNS]
        lines.append("| " + " | ".join([r["workload"], r["mode"], f"{r['drift']:g}", r["staleness"], r["failures"],
                                        *cells]) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=("swebench", "calc", "both"), default="both")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=["colocate_async", "separate_async"])
    ap.add_argument("--drifts", nargs="+", type=float, default=[1e-3, 1e-2, 5e-2],
                    help="log-ratio variance per version and token (scripts/async_drift.py)")
    ap.add_argument("--caps", nargs="+", type=int, default=[DEFAULT_MAX_LAG],
                    help="traj.max_lag of the traj correct rows (default: its default)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--batch", type=int, default=32, help="prompts a step")
    ap.add_argument("--n", type=int, default=4, help="sessions a prompt (the GRPO group)")
    ap.add_argument("--fail-per-call", type=float, default=0.01, help="a tool crash's probability per LLM call")
    ap.add_argument("--timeout-s", type=float, default=None,
                    help="traj.trajectory_timeout_s in the failure runs (simulated seconds; default none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.steps < 6:
        ap.error("--steps must be at least 6 (the first third is warm-up)")
    workloads = [swebench(), calc(args.seed)] if args.workload == "both" else [
        swebench() if args.workload == "swebench" else calc(args.seed)]
    rows = []
    for workload in workloads:
        for mode, staleness, failures, crash, drift in grid(args):
            t0 = time.time()
            res = run(workload, mode, staleness, failures, args, crash, drift)
            rows.append({"workload": workload.name, "mode": mode, "drift": drift, "staleness": staleness,
                         "failures": f"{failures} (crash {crash:g}/call)" if crash else "-", **res})
            print(f"[bench_async_bias] {workload.name} {mode} {staleness} {failures}: {time.time() - t0:.1f} s",
                  file=sys.stderr)
    if args.json:
        print(json.dumps({"args": vars(args), "results": rows}, indent=2))
    else:
        print(f"{args.steps} steps, {args.batch} prompts x {args.n} sessions a step; steady steps "
              f"{args.steps // 3 + 1}..{args.steps}")
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
