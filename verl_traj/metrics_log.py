"""Read verl's logged metrics: the ``file`` logger's JSONL or a captured console log.

``trainer.logger=[console,file]`` with ``VERL_FILE_LOGGER_PATH=...`` writes one ``{"step": s, "data": {...}}``
per step; the console logger prints ``step:N - key:value - ...`` lines. Used by the plotting and comparison
scripts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

__all__ = ["load_metrics", "moving_average", "reward_key"]

PER_TRAJECTORY_REWARD = "traj_reward/mean"  # verl_traj's (v1): each trajectory once, whatever its rows


def reward_key(rows: list[dict]) -> str:
    """The reward the summary and the plot report: per trajectory where the run logged it, else verl's per-row mean
    (``critic/score/mean``: on v1 step rows it weighs a trajectory by its rows)."""
    return PER_TRAJECTORY_REWARD if any(PER_TRAJECTORY_REWARD in r for r in rows) else "critic/score/mean"


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
