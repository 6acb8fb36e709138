#!/usr/bin/env python
"""Plot the reward curve of a verl run from its logged metrics.

    python scripts/plot_reward.py METRICS [-o docs/cpu_reward.png] [--key critic/score/mean]

METRICS is either verl's ``file`` logger output (JSONL, one ``{"step": s, "data": {...}}`` per step;
``trainer.logger=[console,file]`` with ``VERL_FILE_LOGGER_PATH=...``) or a captured console log
(lines ``step:N - key:value - ...``). Prints the first/last values and a moving average.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

_CONSOLE = re.compile(r"step:(\d+) - (.*)")
_KV = re.compile(r"([\w/@.\-]+):(?:np\.\w+\()?(-?[0-9.eE+\-]+|nan|inf)\)?")


def load_metrics(path: str) -> list[dict]:
    rows = []
    text = Path(path).read_text(errors="replace")
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "data" in rec:
                rows.append({"step": rec.get("step"), **rec["data"]})
                continue
        m = _CONSOLE.search(line)
        if m:
            row = {"step": int(m.group(1))}
            for kv in m.group(2).split(" - "):
                km = _KV.fullmatch(kv.strip())
                if km:
                    try:
                        row[km.group(1)] = float(km.group(2))
                    except ValueError:
                        pass
            rows.append(row)
    rows.sort(key=lambda r: r["step"])
    return rows


def moving_average(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics")
    p.add_argument("-o", "--output", default="docs/cpu_reward.png")
    p.add_argument("--key", default="critic/score/mean")
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--title", default="verl_traj on CPU: GRPO, tiny Qwen2 (hidden 64, 2 layers), 'write digits' task")
    args = p.parse_args(argv)

    rows = [r for r in load_metrics(args.metrics) if args.key in r]
    if not rows:
        print(f"no '{args.key}' found in {args.metrics}", file=sys.stderr)
        return 1
    steps = [r["step"] for r in rows]
    values = [float(r[args.key]) for r in rows]
    ma = moving_average(values, args.window)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, values, "o-", ms=3, lw=1, alpha=0.5, label=args.key)
    ax.plot(steps, ma, "-", lw=2, label=f"moving average ({args.window})")
    if "val-core" in " ".join(rows[-1].keys()):
        pass
    ax.set_xlabel("training step")
    ax.set_ylabel("mean reward")
    ax.set_title(args.title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.output, dpi=120)
    k = min(args.window, len(values))
    print(f"{args.key}: steps {steps[0]}..{steps[-1]}; first {values[0]:.3f}, last {values[-1]:.3f}; "
          f"mean of first {k} {sum(values[:k]) / k:.3f}, mean of last {k} {sum(values[-k:]) / k:.3f}, "
          f"max {max(values):.3f}; wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
