#!/usr/bin/env python
"""verl_traj vs stock verl in one command: the same preset, seed and data, ``traj.enable=true`` vs ``false``.

Both runs go through ``python -m verl_traj.main_ppo`` one after the other (verl's file logger on); with the CPU
presets' reproducible sampling (seeded prompt uids and one request priority per session, on v1 also with
``traj.enable=false``) the first step's rollouts are identical in both runs, so the runs are paired at step 1 and
differ afterwards only through how each trained its batches. Writes

* ``OUT/compare.md``: a summary table (per metric: mean over the steps for each run) and a per-step table,
* ``OUT/compare.png``: per-step curves of both runs, one panel per metric,
* ``OUT/compare.json`` and both runs' metrics (``OUT/traj.jsonl``, ``OUT/stock.jsonl``).

Metrics: mean reward, optimizer steps per training step, groups / trajectories split over mini-batches,
padding rows, actor update time, tokens. For the stock run the split counts are observed on verl's own
mini-batches (``stock_plan/*``; nothing changes in what it trains).

    python scripts/compare.py --config-name cpu_tiny --steps 20 [--out compare/] [hydra overrides ...]
    python scripts/compare.py --config-name calc_agent_cpu --steps 10 traj.step_wise=true ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from verl_traj.metrics_log import load_metrics

# (label, key in the verl_traj run, key in the stock run)
ROWS = [
    ("mean reward", "critic/score/mean", "critic/score/mean"),
    ("optimizer steps per step", "actor/num_optimizer_steps", "stock_plan/expected_optimizer_steps"),
    ("groups split over mini-batches", "traj_plan/split_groups", "stock_plan/split_groups"),
    ("trajectories split over mini-batches", "traj_plan/split_trajectories", "stock_plan/split_trajectories"),
    ("padding rows", "traj_plan/padding_rows", "stock_plan/padding_rows"),
    ("actor update time (s)", "timing_s/update_actor", "timing_s/update_actor"),
    ("tokens per step", "perf/total_num_tokens", "perf/total_num_tokens"),
    ("actor grad norm", "actor/grad_norm", "actor/grad_norm"),
]


def run(variant: str, args, out: Path) -> list[dict]:
    metrics = out / f"{variant}.jsonl"
    metrics.unlink(missing_ok=True)
    env = dict(os.environ, VERL_FILE_LOGGER_PATH=str(metrics))
    cmd = [sys.executable, "-m", "verl_traj.main_ppo", "--config-name", args.config_name,
           f"trainer.total_training_steps={args.steps}", "trainer.logger=[console,file]",
           f"traj.enable={'true' if variant == 'traj' else 'false'}", "trainer.resume_mode=disable",
           f"trainer.experiment_name=compare_{variant}", *args.overrides]
    t0 = time.time()
    with open(out / f"{variant}.log", "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if rc != 0:
        raise SystemExit(f"the {variant} run failed (exit {rc}); see {out / f'{variant}.log'}")
    print(f"[compare] {variant}: {args.steps} steps in {time.time() - t0:.0f} s", file=sys.stderr)
    return load_metrics(str(metrics))


def _series(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if key in r]


def _mean(values: list[float]) -> str:
    return f"{sum(values) / len(values):.4g}" if values else "-"


def tables(traj: list[dict], stock: list[dict]) -> str:
    lines = ["| metric | verl_traj (mean over steps) | stock verl (mean over steps) |", "|---|---|---|"]
    lines += [f"| {label} | {_mean(_series(traj, a))} | {_mean(_series(stock, b))} |" for label, a, b in ROWS]
    lines += ["", "| step | " + " | ".join(f"{label}: traj / stock" for label, _, _ in ROWS) + " |",
              "|---|" + "---|" * len(ROWS)]
    by_step = {r["step"]: r for r in stock}
    for r in traj:
        s = by_step.get(r["step"], {})
        cells = [f"{r.get(a, float('nan')):.4g} / {s.get(b, float('nan')):.4g}" for _, a, b in ROWS]
        lines.append(f"| {r['step']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(traj: list[dict], stock: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(ROWS), 1, figsize=(8, 2.0 * len(ROWS)), sharex=True)
    for ax, (label, a, b) in zip(axes, ROWS):
        for rows, key, name in ((traj, a, "verl_traj"), (stock, b, "stock verl")):
            pts = [(r["step"], float(r[key])) for r in rows if key in r]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", linewidth=1.2, label=name)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[-1].set_xlabel("training step")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-name", default="cpu_tiny")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="compare")
    ap.add_argument("overrides", nargs="*", help="hydra overrides applied to both runs")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    traj, stock = run("traj", args, out), run("stock", args, out)
    text = tables(traj, stock)
    cmd = " ".join(["python scripts/compare.py", f"--config-name {args.config_name}", f"--steps {args.steps}",
                    *args.overrides])
    (out / "compare.md").write_text(f"# verl_traj vs stock verl\n\n`{cmd}`\n\n{text}\n")
    (out / "compare.json").write_text(json.dumps({"command": cmd, "traj": traj, "stock": stock}, indent=1))
    plot(traj, stock, out / "compare.png", f"{args.config_name}: verl_traj vs stock verl, same seed and data")
    print(text)
    print(f"\nwrote {out / 'compare.md'}, {out / 'compare.png'}, {out / 'compare.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
