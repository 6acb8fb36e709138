"""One PNG of a run's logged metrics: reward, critic, KL, lengths and turns, and the planner's panels.

Used by ``python -m verl_traj.quickstart`` and ``scripts/plot_metrics.py``; needs matplotlib (the ``plot``
extra). Panels whose metrics the run did not log are left out.
"""

from __future__ import annotations

from pathlib import Path

from verl_traj.metrics_log import moving_average, reward_key

__all__ = ["PANELS", "plot_run"]

PANELS = [
    ("reward", None, "mean reward"),  # None: the run's reward as the summary reports it (metrics_log.reward_key)
    ("critic", ["critic/vf_loss"], "value loss (PPO)"),
    ("kl", ["actor/kl_loss"], "KL to reference"),
    ("response", ["response_length/mean", "num_turns/mean"], "tokens / turns"),
    ("merge", ["traj_stepwise/tokens_before", "traj_stepwise/tokens_after"], "training tokens (step-wise)"),
    ("balance", ["traj_plan/balance_ratio_worst", "traj_plan/balance_ratio_mean"], "slowest rank / lower bound"),
    ("units", ["traj_plan/split_groups", "traj_plan/split_trajectories", "traj_plan/padding_rows",
               "actor/num_optimizer_steps"], "count per step"),
    ("micro", ["traj_plan/micro_batches", "traj_plan/micro_batches_lower_bound"], "micro-batches per step"),
    ("bias", ["traj_bias/tokens_mean_ratio", "traj_bias/turns_mean_ratio"], "length: trained / all (1 = no bias)"),
]


def plot_run(rows: list[dict], output: str | Path, title: str = "verl_traj run", window: int = 5) -> Path:
    """Write the panels of ``rows`` (:func:`verl_traj.metrics_log.load_metrics`) to ``output``; returns it."""
    # local: optional dependency (the `plot` extra); quickstart catches the ImportError and runs without a plot
    import matplotlib

    matplotlib.use("Agg")
    # local: optional (as above), and pyplot must be imported after matplotlib.use("Agg") picks the backend
    import matplotlib.pyplot as plt

    panels = [(name, [k for k in (keys or [reward_key(rows)]) if any(k in r for r in rows)], label)
              for name, keys, label in PANELS]
    panels = [p for p in panels if p[1]]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.3 * len(panels)), sharex=True, squeeze=False)
    for ax, (name, keys, label) in zip(axes[:, 0], panels):
        for key in keys:
            pts = [(r["step"], float(r[key])) for r in rows if key in r and r.get("step") is not None]
            line = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", linewidth=1, alpha=0.6, label=key)[0]
            if name == "reward" and len(pts) >= window:
                ax.plot([p[0] for p in pts], moving_average([p[1] for p in pts], window), color=line.get_color(),
                        linewidth=2.2, label=f"moving average ({window})")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes[-1, 0].set_xlabel("training step")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output
