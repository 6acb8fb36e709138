#!/usr/bin/env python
"""Runs side by side in one command: the same preset, seed and data, one run per variant.

By default two variants, verl_traj (``traj.enable=true``) and stock verl (``traj.enable=false``); ``--variant
NAME=SPEC`` (repeatable) names others, SPEC being hydra overrides for that run only, optionally starting with
``@CONFIG`` for another preset (e.g. ``ppo=@calc_agent_cpu_ppo``). Every run goes through ``python -m
verl_traj.main_ppo`` one after the other (verl's file logger on); with the CPU presets' reproducible sampling (seeded
prompt uids and one request priority per session, on v1 also with ``traj.enable=false``) the first step's rollouts
are identical in every run, so the runs are paired at step 1 and differ afterwards only through how each trained.
Writes

* ``OUT/compare.md``: a summary table (per metric: mean over the steps, and first third -> last third of the steps,
  for each run) and a per-step table,
* ``OUT/compare.png``: per-step curves of every run, one panel per metric,
* ``OUT/compare.json`` and each run's metrics (``OUT/NAME.jsonl``, its log ``OUT/NAME.log``).

With ``--seeds 0,1,2`` every variant runs once per seed (``data.seed`` and ``actor_rollout_ref.rollout.seed``: the
prompt order and the sampling); the tables give each metric's mean over the seeds with the seeds' spread, and the plot
the mean reward with a min-max band over the seeds against training step, tokens trained and wall-clock; at equal
tokens trained and at equal wall-clock (the cheapest variant's totals) each variant's steps reached and the reward over
the last third of them (``scripts/seed_report.py``).

Metrics: mean reward per trajectory (``traj_reward/mean``; verl's ``critic/score/mean`` averages rows), optimizer
steps per training step, the learning rate (the schedule's position), groups and trajectories split over
mini-batches, padding rows, tokens trained, step time. For a stock run (``traj.enable=false``)
the split counts are observed on verl's own mini-batches (``stock_plan/*``; nothing changes in what it trains).

    python scripts/compare.py --config-name cpu_tiny --steps 20 [--out compare/] [hydra overrides for every run ...]
    python scripts/compare.py --out compare/ --report-only [--variant ...]   # tables and plot from finished runs
    python scripts/compare.py --config-name quickstart --steps 30 --seeds 0,1,2 --variant quick=   # over seeds
    python scripts/compare.py --config-name calc_agent_cpu --steps 30 --out compare_turns \\
        --variant stock=traj.enable=false --variant grpo= --variant ppo_gae=@calc_agent_cpu_ppo \\
        traj.step_wise=true 'actor_rollout_ref.rollout.agent.agent_loop_config_path=${verl_traj_pkg:}/configs/agent_loops/stepwise.yaml'
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

# scripts/ is sys.path[0] when this file runs as a script (its only use)
from seed_report import at_equal_budget, metric_series, plot_seeds, rolling_mean, seed_tables, verdicts

from verl_traj.metrics_log import load_metrics

# (label, key in a verl_traj run, key in a stock run)
ROWS = [  # the five first (the README plot shows them: --panels 5)
    ("mean reward per trajectory", "traj_reward/mean", "traj_reward/mean"),
    ("optimizer steps per step", "actor/num_optimizer_steps", "stock_plan/expected_optimizer_steps"),
    ("tokens trained per step", "perf/total_num_tokens", "perf/total_num_tokens"),
    ("trajectories split over mini-batches", "traj_plan/split_trajectories", "stock_plan/split_trajectories"),
    ("learning rate", "actor/lr", "actor/lr"),
    ("groups split over mini-batches", "traj_plan/split_groups", "stock_plan/split_groups"),
    ("padding rows", "traj_plan/padding_rows", "stock_plan/padding_rows"),
    ("step time (s)", "timing_s/step", "timing_s/step"),
    ("actor grad norm", "actor/grad_norm", "actor/grad_norm"),
]
DEFAULT_VARIANTS = ("traj=traj.enable=true", "stock=traj.enable=false")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One run: its name, its preset (``None``: the common ``--config-name``) and its own hydra overrides."""

    name: str
    config_name: str | None
    overrides: tuple[str, ...]

    @property
    def stock(self) -> bool:
        """A stock-verl run reads the ``stock_plan/*`` observer keys (the last ``traj.enable`` override wins)."""
        enables = [o.split("=", 1)[1].strip().lower() for o in self.overrides if o.startswith("traj.enable=")]
        return bool(enables) and enables[-1] in ("false", "0")

    def key(self, row: tuple[str, str, str]) -> str:
        return row[2] if self.stock else row[1]


def parse_variant(spec: str) -> Variant:
    """``NAME=[@CONFIG] [OVERRIDE ...]`` (shell-quoted) -> :class:`Variant`; a clear error otherwise."""
    name, sep, rest = spec.partition("=")
    if not sep or not name.isidentifier():
        raise SystemExit(f"--variant {spec!r}: expected NAME=[@CONFIG] [OVERRIDES] with NAME a plain word, e.g. "
                         "--variant stock=traj.enable=false or --variant ppo=@calc_agent_cpu_ppo")
    tokens = shlex.split(rest)
    config = tokens.pop(0)[1:] if tokens and tokens[0].startswith("@") else None
    if config == "":
        raise SystemExit(f"--variant {spec!r}: '@' must be followed by a preset name (e.g. @calc_agent_cpu_ppo)")
    return Variant(name, config, tuple(tokens))


def run_name(variant: Variant, seed: Optional[int]) -> str:
    """``NAME`` (the preset's seed) or ``NAME.sSEED``: the stem of the run's metrics and log files."""
    return variant.name if seed is None else f"{variant.name}.s{seed}"


def run(variant: Variant, args, out: Path, seed: Optional[int] = None) -> list[dict]:
    name = run_name(variant, seed)
    metrics = out / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    env = dict(os.environ, VERL_FILE_LOGGER_PATH=str(metrics))
    seeded = [] if seed is None else [f"data.seed={seed}", f"actor_rollout_ref.rollout.seed={seed}"]
    cmd = [sys.executable, "-m", "verl_traj.main_ppo", "--config-name", variant.config_name or args.config_name,
           f"trainer.total_training_steps={args.steps}", "trainer.logger=[console,file]",
           "trainer.resume_mode=disable", f"trainer.experiment_name=compare_{name}", *args.overrides,
           *variant.overrides, *seeded]
    t0 = time.time()
    with open(out / f"{name}.log", "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if rc != 0:
        raise SystemExit(f"the {name} run failed (exit {rc}); see {out / f'{name}.log'}")
    print(f"[compare] {name}: {args.steps} steps in {time.time() - t0:.0f} s", file=sys.stderr)
    return load_metrics(str(metrics))


def _fmt(values: list[float]) -> str:
    return f"{sum(values) / len(values):.4g}" if values else "-"


def _trend(values: list[float]) -> str:
    """mean over all steps, and first third -> last third (a trend readable through per-step noise)."""
    if len(values) < 3:
        return _fmt(values)
    third = len(values) // 3
    return f"{_fmt(values)} ({_fmt(values[:third])} → {_fmt(values[-third:])})"


def tables(runs: dict[Variant, list[dict]]) -> str:
    names = [v.name for v in runs]
    lines = ["| metric | " + " | ".join(f"{n}: mean (first third → last third)" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    lines += [f"| {row[0]} | " + " | ".join(_trend(metric_series(rows, v.key(row))) for v, rows in runs.items()) + " |"
              for row in ROWS]
    lines += ["", "| step | " + " | ".join(f"{row[0]}: {' / '.join(names)}" for row in ROWS) + " |",
              "|---|" + "---|" * len(ROWS)]
    by_step = {v: {r["step"]: r for r in rows} for v, rows in runs.items()}
    for step in sorted({s for steps in by_step.values() for s in steps}):
        cells = [" / ".join(f"{by_step[v].get(step, {}).get(v.key(row), float('nan')):.4g}" for v in runs)
                 for row in ROWS]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: dict[Variant, list[dict]], path: Path, title: str, panels: int = len(ROWS), window: int = 1) -> None:
    """One panel per metric of the first ``panels`` rows of :data:`ROWS`; ``window`` > 1 plots rolling means."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows_shown = ROWS[:panels]
    fig, axes = plt.subplots(len(rows_shown), 1, figsize=(8, 2.0 * len(rows_shown)), sharex=True, squeeze=False)
    for ax, row in zip(axes[:, 0], rows_shown):
        for variant, rows in runs.items():
            pts = [(r["step"], float(r[variant.key(row)])) for r in rows if variant.key(row) in r]
            if pts:
                ax.plot([p[0] for p in pts], rolling_mean([p[1] for p in pts], window), linewidth=1.4, label=variant.name)
        ax.set_ylabel(row[0] + (f"\n(mean of {window} steps)" if window > 1 else ""), fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel("training step")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _load(out: Path, variants: list, seeds: list) -> dict:
    """``--report-only``: each variant's finished runs (one per seed)."""
    missing = [str(out / f"{run_name(v, s)}.jsonl") for v in variants for s in seeds
               if not (out / f"{run_name(v, s)}.jsonl").is_file()]
    if missing:
        raise SystemExit(f"--report-only: no metrics at {missing}; run without --report-only first")
    return {v: {s: load_metrics(str(out / f"{run_name(v, s)}.jsonl")) for s in seeds} for v in variants}


def _extend_rows(reward_key: Optional[str], metrics: list[str]) -> None:
    """``--reward-key`` and ``--metric``: the rows this command reports (module state: one command a process)."""
    if reward_key:
        ROWS[0] = (f"mean reward ({reward_key})", reward_key, reward_key)
    for spec in metrics:
        label, sep, key = spec.rpartition("=")
        if not sep or not label or not key:
            raise SystemExit(f"--metric {spec!r}: expected LABEL=KEY, e.g. 'tree tokens=actor/tree_tokens'")
        ROWS.append((label, key, key))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-name", default="cpu_tiny")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="compare")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=[@CONFIG] [OVERRIDES]",
                    help="a run of its own (repeatable; default: traj and stock)")
    ap.add_argument("--panels", type=int, default=len(ROWS), help="plot the first N metrics only (reward first)")
    ap.add_argument("--window", type=int, default=1, help="plot rolling means over this many steps")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: rebuild the tables and the plot from the variants' OUT/NAME.jsonl")
    ap.add_argument("--seeds", default="", help="comma-separated seeds: each variant runs once per seed (data.seed, "
                    "actor_rollout_ref.rollout.seed); the report gives means and spreads over them")
    ap.add_argument("--reward-key", default=None, help="the reward row reads this metric in every run (e.g. "
                    "traj_tree/leaf_outcome_mean: a branching agent's leaves)")
    ap.add_argument("--metric", action="append", default=[], metavar="LABEL=KEY",
                    help="one more row, read from KEY in every run (repeatable)")
    ap.add_argument("overrides", nargs="*", help="hydra overrides applied to every run")
    args = ap.parse_args(argv)
    _extend_rows(args.reward_key, args.metric)
    variants = [parse_variant(s) for s in (args.variant or DEFAULT_VARIANTS)]
    if len({v.name for v in variants}) != len(variants):
        raise SystemExit(f"--variant names must differ: {[v.name for v in variants]}")
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()] or [None]
    except ValueError:
        raise SystemExit(f"--seeds {args.seeds!r}: expected comma-separated integers, e.g. --seeds 0,1,2")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs = _load(out, variants, seeds) if args.report_only else \
        {v: {s: run(v, args, out, s) for s in seeds} for v in variants}
    single = seeds == [None]
    text = tables({v: r[None] for v, r in runs.items()}) if single else "\n\n".join(
        [seed_tables(runs, ROWS), verdicts(runs, ROWS[0]) + "\n" + at_equal_budget(runs, ROWS[0])])
    cmd = shlex.join(["python", "scripts/compare.py", "--config-name", args.config_name, "--steps", str(args.steps),
                      *([f"--seeds={args.seeds}"] if not single else []),
                      *[f"--variant={s}" for s in args.variant],
                      *([f"--reward-key={args.reward_key}"] if args.reward_key else []),
                      *[f"--metric={m}" for m in args.metric], *args.overrides])
    (out / "compare.md").write_text(f"# side by side\n\n`{cmd}`\n\n{text}\n")
    (out / "compare.json").write_text(json.dumps(
        {"command": cmd, "seeds": seeds,
         "runs": {v.name: {"config_name": v.config_name or args.config_name, "overrides": list(v.overrides),
                           **({"metrics": r[None]} if single else {"metrics_by_seed": {str(s): m for s, m in r.items()}})}
                  for v, r in runs.items()}}, indent=1))
    title = f"{args.config_name}: {' vs '.join(v.name for v in variants)}"
    if single:
        plot({v: r[None] for v, r in runs.items()}, out / "compare.png", f"{title}, same seed and data",
             panels=max(1, min(args.panels, len(ROWS))), window=max(1, args.window))
    else:
        plot_seeds(runs, out / "compare.png", f"{title}, seeds {args.seeds}", ROWS[0], window=max(1, args.window))
    print(text)
    print(f"\nwrote {out / 'compare.md'}, {out / 'compare.png'}, {out / 'compare.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
