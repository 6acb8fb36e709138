"""scripts/compare.py's report over seeds: each variant's runs ``{Variant: {seed: [metrics row, ...]}}`` (a row: one
step's logged metrics, as ``verl_traj.metrics_log.load_metrics`` reads them); a metric is a ``(label, key in a
verl_traj run, key in a stock run)`` tuple, read through ``Variant.key``. Pure arithmetic and one plot, no runs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional


def metric_series(rows: list[dict], key: str) -> list[float]:
    """The values of ``key`` at the steps that logged it, in step order."""
    return [float(r[key]) for r in rows if key in r]


def rolling_mean(values: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values at each step (fewer at the start)."""
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]


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
    """One table cell: the mean over seeds of first third -> last third, the mean trend and each seed's."""
    if not any(per_seed):
        return "-"
    t = seed_trend(per_seed)
    each = ", ".join(f"{d:+.3g}" for d in t["trends"])
    return f"{t['first']:.4g} → {t['last']:.4g} ({t['trend']:+.3g}; seeds {each})"


def seed_tables(runs: dict, metrics: list[tuple[str, str, str]]) -> str:
    """Tables over seeds: per metric and variant, the mean over seeds of first third -> last third with each seed's
    trend; then the mean reward per step (``metrics[0]``), mean [min, max] over the seeds."""
    reward = metrics[0]
    names = [v.name for v in runs]
    lines = ["| metric | " + " | ".join(f"{n}: first third → last third, mean over seeds (trend; each seed's)"
                                         for n in names) + " |", "|---|" + "---|" * len(names)]
    for row in metrics:
        cells = [_seed_cell([metric_series(rows, v.key(row)) for rows in seeds.values()]) for v, seeds in runs.items()]
        lines.append(f"| {row[0]} | " + " | ".join(cells) + " |")
    lines += ["", "| step | " + " | ".join(f"{n}: {reward[0]}, mean [min, max] over seeds" for n in names) + " |",
              "|---|" + "---|" * len(names)]
    series = {v: [metric_series(rows, v.key(reward)) for rows in seeds.values()] for v, seeds in runs.items()}
    for i in range(max(len(x) for per in series.values() for x in per)):
        cells = []
        for per in series.values():
            at = [x[i] for x in per if i < len(x)]
            cells.append(f"{_mean(at):.3f} [{min(at):.3f}, {max(at):.3f}]" if at else "-")
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdicts(runs: dict, reward: tuple[str, str, str]) -> str:
    """One line per variant: the reward's trend over the seeds, next to how far apart the seeds are."""
    out = []
    for v, seeds in runs.items():
        t = seed_trend([metric_series(rows, v.key(reward)) for rows in seeds.values()])
        if not t["trends"]:
            out.append(f"{v.name}: no {reward[0]} logged")
            continue
        out.append(f"{v.name}: {reward[0]} {t['first']:.3f} → {t['last']:.3f} (first → last third, mean of "
                   f"{len(seeds)} seeds): trend {t['trend']:+.3f}, each seed {', '.join(f'{d:+.3f}' for d in t['trends'])}"
                   f"; the seeds' trends span {max(t['trends']) - min(t['trends']):.3f}, one step's reward "
                   f"{t['step_spread']:.3f} (mean max - min over the seeds)")
    return "\n".join(out)


AXES = (("training step", None), ("tokens trained", "perf/total_num_tokens"), ("wall-clock (s)", "timing_s/step"))


def plot_seeds(runs: dict, path: Path, title: str, reward: tuple[str, str, str], window: int = 1) -> None:
    """The mean reward per trajectory of each variant against training step, tokens trained (cumulative) and
    wall-clock (cumulative step time): the mean over seeds at each step (at the seeds' mean x), and a min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(AXES), figsize=(5 * len(AXES), 3.6), sharey=True, squeeze=False)
    for ax, (label, key) in zip(axes[0], AXES):
        for v, seeds in runs.items():
            per = [(rolling_mean(metric_series(rows, v.key(reward)), window),
                    _cumulative(rows, key, v.key(reward))) for rows in seeds.values()]
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
    axes[0, 0].set_ylabel(reward[0] + (f" (mean of {window} steps)" if window > 1 else ""), fontsize=8)
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


BUDGETS = (("tokens trained", "perf/total_num_tokens", ""), ("wall-clock", "timing_s/step", " s"))


def at_equal_budget(runs: dict, reward: tuple[str, str, str]) -> str:
    """The reward at equal cost, one line per axis of :data:`BUDGETS` (tokens trained, wall-clock: the running sums
    of ``perf/total_num_tokens`` and ``timing_s/step``). The budget is the least total any variant spends (the mean
    over its seeds); every seed of every variant is cut at its last step within it, and each variant gets the steps
    reached (min-max over its seeds) and the reward's mean over the last third of those steps (mean over the seeds
    that reached a step: the tables' "last third", on the steps the budget buys). An axis whose cost is not logged,
    or not finite, at a step that logged the reward says so instead of comparing."""
    out = []
    for label, key, unit in BUDGETS:
        unlogged = [f"{v.name} seed {seed}" for v, seeds in runs.items() for seed, rows in seeds.items()
                    if any(v.key(reward) in r and not math.isfinite(float(r.get(key, "nan"))) for r in rows)]
        if unlogged:
            out.append(f"at equal {label}: not compared ({key} missing or not finite in {', '.join(unlogged)})")
            continue
        out.append(_budget_line(runs, reward, label, key, unit))
    return "\n".join(out)


def _budget_line(runs: dict, reward: tuple[str, str, str], label: str, key: str, unit: str) -> str:
    cost = {v: [(_cumulative(rows, key, v.key(reward)), metric_series(rows, v.key(reward))) for rows in seeds.values()]
            for v, seeds in runs.items()}
    totals = {v: _mean([xs[-1] for xs, _ in per if xs]) for v, per in cost.items() if any(xs for xs, _ in per)}
    if not totals:
        return f"at equal {label}: not compared (no {reward[0]} logged)"
    least = min(totals, key=lambda v: totals[v])
    budget, cells = totals[least], []
    for v, per in cost.items():
        reached = [sum(x <= budget * (1 + 1e-9) for x in xs) for xs, _ in per] or [0]
        last = [_mean(ys[:n][-max(n // 3, 1):]) for (_, ys), n in zip(per, reached) if n]
        cells.append(f"{v.name} {min(reached)}-{max(reached)} steps, last third {_mean(last):.3f}")
    return f"at equal {label} ({budget:,.0f}{unit}: {least.name}'s total, mean of its seeds): " + "; ".join(cells)
