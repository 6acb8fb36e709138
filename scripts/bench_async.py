#!/usr/bin/env python
"""Who waits for whom, in each of verl's v1 trainer modes: the trainer for rollouts, the rollout pool for the trainer.

Runs ``python -m verl_traj.main_ppo`` once per mode (sync, ``colocate_async``, ``separate_async``) on the same preset
and steps (default: the calculator agent, ``calc_agent_cpu``), each with verl's file logger, and reads per step:

* **trainer waiting for rollouts**: verl's ``timing_s/gen`` (in sync the whole generation; in the async modes the
  time the trainer blocks in the replay buffer until a batch is sampleable) over ``timing_s/step``;
* **rollout pool busy**: ``rollout_pool/<pool>_busy_share`` (verl_traj, from the CPU rollout servers' generation
  seconds): the share of the step's wall time the pool's servers spent generating; ``hybrid`` = the replicas on the
  trainer's workers, ``standalone`` = ``separate_async``'s own pool. Idle = 1 - busy;
* seconds per step, the mean trajectory staleness (``traj_version/staleness_mean``) and the length bias of what
  trained (``traj_bias/tokens_mean_ratio``; on a long-tailed agent, per policy: ``scripts/bench_async_bias.py``).

Every figure is the median over the steps after the first (the first includes warm-up). The runs are sequential on
the same machine; compare modes as ratios within one invocation.

    python scripts/bench_async.py [--config-name calc_agent_cpu] [--steps 6] [--modes sync colocate_async
        separate_async] [--out bench_async] [--json] [-- EXTRA HYDRA OVERRIDES]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ("sync", "colocate_async", "separate_async")
COLUMNS = (("s/step", "timing_s/step"), ("trainer waiting for rollouts", None),
           ("hybrid pool busy", "rollout_pool/hybrid_busy_share"),
           ("standalone pool busy", "rollout_pool/standalone_busy_share"),
           ("staleness (versions, mean)", "traj_version/staleness_mean"),
           ("length ratio (trained / all)", "traj_bias/tokens_mean_ratio"))


def run_mode(mode: str, args, out: Path) -> list[dict]:
    metrics = out / f"{mode}.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "verl_traj.main_ppo", "--config-name", args.config_name,
           f"trainer.v1.trainer_mode={mode}", f"trainer.total_training_steps={args.steps}",
           "trainer.logger=[console,file]", "trainer.resume_mode=disable", "trainer.save_freq=-1",
           f"trainer.experiment_name=bench_async_{mode}", *args.overrides]
    t0 = time.time()
    with open(out / f"{mode}.log", "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT,
                             env=dict(os.environ, VERL_FILE_LOGGER_PATH=str(metrics)))
    if rc != 0:
        raise SystemExit(f"the {mode} run failed (exit {rc}); see {out / f'{mode}.log'}")
    print(f"[bench_async] {mode}: {args.steps} steps in {time.time() - t0:.0f} s", file=sys.stderr)
    return [json.loads(line)["data"] for line in metrics.read_text().splitlines() if line.strip()]


def summarise(rows: list[dict]) -> dict[str, float | None]:
    later = rows[1:] or rows
    out = {}
    for name, key in COLUMNS:
        if key is None:
            values = [r["timing_s/gen"] / r["timing_s/step"] for r in later if r.get("timing_s/step")]
        else:
            values = [r[key] for r in later if key in r]
        out[name] = statistics.median(values) if values else None
    return out


def table(report: dict[str, dict]) -> str:
    names = [name for name, _ in COLUMNS]
    lines = ["| mode | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for mode, res in report.items():
        cells = []
        for name in names:
            value = res[name]
            share = name != "s/step" and not name.startswith(("staleness", "length"))
            cells.append("-" if value is None else f"{value:.0%}" if share else f"{value:.2f}")
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-name", default="calc_agent_cpu")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--out", default="bench_async")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ap.add_argument("overrides", nargs="*", help="hydra overrides for every run (after --)")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first step is left out of the medians)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {mode: summarise(run_mode(mode, args, out)) for mode in args.modes}
    if args.json:
        print(json.dumps({"config_name": args.config_name, "steps": args.steps, "overrides": args.overrides,
                          "results": report}, indent=2))
    else:
        print(f"{args.config_name}, {args.steps} steps per mode, medians over steps 2..{args.steps}")
        print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
