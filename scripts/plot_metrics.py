#!/usr/bin/env python
"""Turn a verl run's logged metrics into one PNG of panels: reward, response length and turns, and
verl_traj's planner statistics.

    python scripts/plot_metrics.py METRICS -o docs/calc_agent_cpu.png [--title ...]

METRICS: verl's ``file`` logger JSONL (``trainer.logger=[console,file]``, ``VERL_FILE_LOGGER_PATH``)
or a captured console log, as for ``scripts/plot_reward.py`` (whose loader this reuses).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_reward import load_metrics, moving_average  # noqa: E402

PANELS = [
    ("reward", ["critic/score/mean"], "mean reward"),
    ("response", ["response_length/mean", "num_turns/mean"], "tokens / turns"),
    ("balance", ["traj_plan/balance_ratio_worst", "traj_plan/balance_ratio_mean"], "slowest rank / lower bound"),
    ("units", ["traj_plan/split_groups", "traj_plan/split_trajectories", "traj_plan/padding_rows",
               "actor/num_optimizer_steps"], "count per step"),
    ("micro", ["traj_plan/micro_batches", "traj_plan/micro_batches_lower_bound"], "micro-batches per step"),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics")
    parser.add_argument("-o", "--output", required=True)
    parser.add_argument("--title", default="verl_traj run")
    parser.add_argument("--window", type=int, default=5)
    args = parser.parse_args(argv)

    rows = load_metrics(args.metrics)
    if not rows:
        print(f"no metrics found in {args.metrics}: log with trainer.logger=[console,file]", file=sys.stderr)
        return 1
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(name, [k for k in keys if any(k in r for r in rows)], label) for name, keys, label in PANELS]
    panels = [p for p in panels if p[1]]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.3 * len(panels)), sharex=True)
    axes = [axes] if len(panels) == 1 else list(axes)
    for ax, (name, keys, label) in zip(axes, panels):
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if key in r and r.get("step") is not None]
            steps, values = [p[0] for p in pts], [float(p[1]) for p in pts]
            line = ax.plot(steps, values, marker=".", linewidth=1, alpha=0.6, label=key)[0]
            if name == "reward" and len(values) >= args.window:
                ax.plot(steps, moving_average(values, args.window), color=line.get_color(), linewidth=2.2,
                        label=f"moving average ({args.window})")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes[-1].set_xlabel("training step")
    fig.suptitle(args.title, fontsize=10)
    fig.tight_layout()
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.output, dpi=110)
    rewards = [r["critic/score/mean"] for r in rows if "critic/score/mean" in r]
    if rewards:
        head, tail = rewards[: args.window], rewards[-args.window:]
        print(f"{len(rows)} steps; reward first {len(head)} mean {sum(head) / len(head):.3f}, "
              f"last {len(tail)} mean {sum(tail) / len(tail):.3f}; wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
