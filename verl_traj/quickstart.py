"""The quick start: ``python -m verl_traj.quickstart [hydra overrides ...]``.

1. prepares the calculator-agent recipe offline, once (data, tiny model, short supervised warm start:
   :mod:`verl_traj.recipes.calc_agent.prepare`; about 2 minutes on 2 cores, cached under ``$VERL_TRAJ_HOME``);
2. trains the multi-turn agent for a few steps with step-wise rows and prefix merging
   (``--config-name quickstart``; extra arguments are hydra overrides, e.g. ``trainer.total_training_steps=10``);
3. prints what verl_traj did (:func:`verl_traj.summary.summarize`), what the prepared model did before training
   (:func:`prepared_summary`: its evaluation's accuracy and the tool calls it wrote malformed, counted as training
   counts them, never logged as errors), and writes a plot of the run.

Outputs go to ``$VERL_TRAJ_OUT`` (default ``./verl_traj_quickstart``): ``metrics.jsonl``, ``run.png``, ``train.log``.
Works from a checkout or from an installed wheel (the configs ship with the package).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from verl_traj.metrics_log import load_metrics
from verl_traj.plots import plot_run
from verl_traj.summary import summarize


def _home() -> Path:
    return Path(os.environ.get("VERL_TRAJ_HOME", Path.home() / ".cache" / "verl_traj"))


def prepared_summary(model_dir: Path) -> str:
    """One summary line from the prepared model's ``WARM_START.json`` (written by the prepare step's evaluation):
    its greedy and sampled accuracy and the tool calls it wrote malformed; ``""`` when it has no evaluation."""
    stamp = model_dir / "WARM_START.json"
    figures = json.loads(stamp.read_text()) if stamp.is_file() else {}
    if "sampled_accuracy" not in figures:
        return ""
    line = (f"- the prepared model before training (its evaluation when prepared): accuracy "
            f"{figures['greedy_accuracy']:.2f} greedy, {figures['sampled_accuracy']:.2f} sampled")
    if "sampled_malformed_calls" not in figures:
        return line + "; its malformed tool calls were not counted (prepared by an older verl_traj: delete the cache)"
    return line + (f"; malformed tool calls in that evaluation (counted, not logged as errors): "
                   f"{figures['greedy_malformed_calls']} greedy, {figures['sampled_malformed_calls']} sampled "
                   f"({figures['sampled_malformed_call_share']:.1%} of its sampled calls)")


def _run(cmd: list[str], env: dict, log: Path | None = None) -> None:
    print("[quickstart] " + " ".join(cmd), flush=True)
    if log is None:
        rc = subprocess.call(cmd, env=env)
    else:
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for line in proc.stdout:  # the console metrics stay visible, the whole log is kept
                f.write(line)
                if "Training Progress" in line or "Error" in line:
                    sys.stdout.write(line)
            rc = proc.wait()
    if rc != 0:
        raise SystemExit(f"[quickstart] failed (exit {rc}): {' '.join(cmd)}" + (f"; see {log}" if log else ""))


def main(argv: list[str] | None = None) -> int:
    overrides = list(sys.argv[1:] if argv is None else argv)
    out = Path(os.environ.get("VERL_TRAJ_OUT", "verl_traj_quickstart")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    env = dict(os.environ, VERL_TRAJ_HOME=str(_home()), VERL_FILE_LOGGER_PATH=str(metrics))
    _run([sys.executable, "-m", "verl_traj.recipes.calc_agent.prepare", "--home", str(_home() / "calc_agent")], env)
    _run([sys.executable, "-m", "verl_traj.main_ppo", "--config-name", "quickstart", "trainer.logger=[console,file]",
          *overrides], env, log=out / "train.log")
    rows = load_metrics(str(metrics))
    plot = ""
    try:
        plot = str(plot_run(rows, out / "run.png", "verl_traj quick start: calculator agent, step-wise rows"))
    except ImportError:
        print("[quickstart] matplotlib is not installed (pip install 'verl_traj[plot]'): no plot", flush=True)
    print("\n" + "\n".join(filter(None, [summarize(rows, str(metrics), plot),
                                           prepared_summary(_home() / "calc_agent" / "model")])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
