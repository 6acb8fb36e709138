#!/usr/bin/env python
"""Turn a verl run's logged metrics into one PNG of panels (reward, critic, KL, lengths and turns, step-wise
tokens, DP balance, units / padding / optimizer steps, micro-batches): :mod:`verl_traj.plots`.

    python scripts/plot_metrics.py METRICS -o docs/calc_agent_cpu.png [--title ...] [--window 10]

METRICS is verl's ``file`` logger output (``trainer.logger=[console,file]`` with ``VERL_FILE_LOGGER_PATH``)
or a captured console log (:mod:`verl_traj.metrics_log`).
"""

from __future__ import annotations

import argparse
import sys

from verl_traj.metrics_log import load_metrics
from verl_traj.plots import plot_run


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
    plot_run(rows, args.output, args.title, args.window)
    rewards = [r["critic/score/mean"] for r in rows if "critic/score/mean" in r]
    if rewards:
        head, tail = rewards[: args.window], rewards[-args.window:]
        print(f"{len(rows)} steps; reward first {len(head)} mean {sum(head) / len(head):.3f}, "
              f"last {len(tail)} mean {sum(tail) / len(tail):.3f}; wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
