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
the mean reward with a min-max band over the seeds against training step, tokens trained and wall-clock.

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


def _series(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if key in r]


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
    lines += [f"| {row[0]} | " + " | ".join(_trend(_series(rows, v.key(row))) for v, rows in runs.items()) + " |"
              for row in ROWS]
    lines += ["", "| step | " + " | ".join(f"{row[0]}: {' / '.join(names)}" for row in ROWS) + " |",
              "|---|" + "---|" * len(ROWS)]
    by_step = {v: {r["step"]: r for r in rows} for v, rows in runs.items()}
    for step in sorted({s for steps in by_step.values() for s in steps}):
        cells = [" / ".join(f"{by_step[v].get(step, {}).get(v.key(row), float('nan')):.4g}" for v in runs)
                 for row in ROWS]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def seed_trend(per_seed: list[list[float]]) -> dict:
    """Each seed's first third -> last third of its steps (means) and the trend between, over ``S`` seeds' series:
    ``first``, ``last``, ``trend`` (means over the seeds), ``trends`` (each seed's), ``step_spread`` (mean over the
    steps of max - min across the seeds: how far apart seeds are at one step)."""
    thirds = [(_mean(v[:max(len(v) // 3, 1)]), _mean(v[-max(len(v) // 3, 1):])) for v in per_seed if v]
    trends = [last - first for first, last in thirds]
    steps = min((len(v) for v in per_seed), default=0)
    spread = _mean([max(v[i] for v in per_seed) - min(v[i] for v in per_seed) for i in range(steps)])
    return {"first": _mean([f for f, _ in thirds]), "last": _mean([l for _, l in thirds]), "trend": _mean(trends),
            "trends": trends, "step_spread": spread}


def _seed_cell(per_seed: list[list[float]]) -> str:
    if not any(per_seed):
        return "-"
    t = seed_trend(per_seed)
    each = ", ".join(f"{d:+.3g}" for d in t["trends"])
    return f"{t['first']:.4g} → {t['last']:.4g} ({t['trend']:+.3g}; seeds {each})"


def seed_tables(runs: dict) -> str:
    """Tables over seeds: per metric and variant, the mean over seeds of first third -> last third with each seed's
    trend; then the mean reward per step, mean [min, max] over the seeds."""
    names = [v.name for v in runs]
    lines = ["| metric | " + " | ".join(f"{n}: first third → last third, mean over seeds (trend; each seed's)"
                                         for n in names) + " |", "|---|" + "---|" * len(names)]
    for row in ROWS:
        cells = [_seed_cell([_series(rows, v.key(row)) for rows in seeds.values()]) for v, seeds in runs.items()]
        lines.append(f"| {row[0]} | " + " | ".join(cells) + " |")
    lines += ["", "| step | " + " | ".join(f"{n}: {ROWS[0][0]}, mean [min, max] over seeds" for n in names) + " |",
              "|---|" + "---|" * len(names)]
    series = {v: [_series(rows, v.key(ROWS[0])) for rows in seeds.values()] for v, seeds in runs.items()}
    for i in range(max(len(x) for per in series.values() for x in per)):
        cells = []
        for per in series.values():
            at = [x[i] for x in per if i < len(x)]
            cells.append(f"{_mean(at):.3f} [{min(at):.3f}, {max(at):.3f}]" if at else "-")
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdicts(runs: dict) -> str:
    """One line per variant: the reward's trend over the seeds, next to how far apart the seeds are."""
    out = []
    for v, seeds in runs.items():
        t = seed_trend([_series(rows, v.key(ROWS[0])) for rows in seeds.values()])
        if not t["trends"]:
            out.append(f"{v.name}: no {ROWS[0][0]} logged")
            continue
        out.append(f"{v.name}: {ROWS[0][0]} {t['first']:.3f} → {t['last']:.3f} (first → last third, mean of "
                   f"{len(seeds)} seeds): trend {t['trend']:+.3f}, each seed {', '.join(f'{d:+.3f}' for d in t['trends'])}"
                   f"; the seeds' trends span {max(t['trends']) - min(t['trends']):.3f}, one step's reward "
                   f"{t['step_spread']:.3f} (mean max - min over the seeds)")
    return "\n".join(out)


def _rolling(values: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values at each step (fewer at the start)."""
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]


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
                ax.plot([p[0] for p in pts], _rolling([p[1] for p in pts], window), linewidth=1.4, label=variant.name)
        ax.set_ylabel(row[0] + (f"\n(mean of {window} steps)" if window > 1 else ""), fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel("training step")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


AXES = (("training step", None), ("tokens trained", "perf/total_num_tokens"), ("wall-clock (s)", "timing_s/step"))


def plot_seeds(runs: dict, path: Path, title: str, window: int = 1) -> None:
    """The mean reward per trajectory of each variant against training step, tokens trained (cumulative) and
    wall-clock (cumulative step time): the mean over seeds at each step (at the seeds' mean x), and a min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(AXES), figsize=(5 * len(AXES), 3.6), sharey=True, squeeze=False)
    for ax, (label, key) in zip(axes[0], AXES):
        for v, seeds in runs.items():
            per = [(_rolling(_series(rows, v.key(ROWS[0])), window),
                    _cumulative(rows, key, v.key(ROWS[0]))) for rows in seeds.values()]
            n = min(len(y) for y, _ in per)
            if not n:
                continue
            x = [_mean([xs[i] for _, xs in per]) for i in range(n)]
            ys = [[y[i] for y, _ in per] for i in range(n)]
            line = ax.plot(x, [_mean(y) for y in ys], linewidth=1.6, label=f"{v.name} ({len(per)} seeds)")[0]
            ax.fill_between(x, [min(y) for y in ys], [max(y) for y in ys], color=line.get_color(), alpha=0.18)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0, 0].set_ylabel(ROWS[0][0] + (f" (mean of {window} steps)" if window > 1 else ""), fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _cumulative(rows: list[dict], key: Optional[str], present: str) -> list[float]:
    """The x of each step that logged ``present``: its step number (``key`` None), else the running sum of ``key``."""
    xs, total = [], 0.0
    for r in rows:
        total += float(r.get(key, 0.0)) if key else 0.0
        if present in r:
            xs.append(total if key else float(r["step"]))
    return xs


def _load(out: Path, variants: list, seeds: list) -> dict:
    """``--report-only``: each variant's finished runs (one per seed)."""
    missing = [str(out / f"{run_name(v, s)}.jsonl") for v in variants for s in seeds
               if not (out / f"{run_name(v, s)}.jsonl").is_file()]
    if missing:
        raise SystemExit(f"--report-only: no metrics at {missing}; run without --report-only first")
    return {v: {s: load_metrics(str(out / f"{run_name(v, s)}.jsonl")) for s in seeds} for v in variants}


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
    ap.add_argument("overrides", nargs="*", help="hydra overrides applied to every run")
    args = ap.parse_args(argv)
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
    text = tables({v: r[None] for v, r in runs.items()}) if single else seed_tables(runs) + "\n\n" + verdicts(runs)
    cmd = shlex.join(["python", "scripts/compare.py", "--config-name", args.config_name, "--steps", str(args.steps),
                      *([f"--seeds={args.seeds}"] if not single else []),
                      *[f"--variant={s}" for s in args.variant], *args.overrides])
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
        plot_seeds(runs, out / "compare.png", f"{title}, seeds {args.seeds}", window=max(1, args.window))
    print(text)
    print(f"\nwrote {out / 'compare.md'}, {out / 'compare.png'}, {out / 'compare.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
