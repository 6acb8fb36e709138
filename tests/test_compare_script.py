"""scripts/compare.py's report (``--report-only``: tables and plot from finished runs' metrics), on two hand-written
runs: a verl_traj variant reads ``traj_plan/*``, a stock variant (``traj.enable=false``) verl's observed
``stock_plan/*``; each metric's mean and first-third -> last-third trend; a bad ``--variant`` names the fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps({"step": i + 1, "data": r}) + "\n" for i, r in enumerate(rows)))


def _compare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "compare.py"), *args], capture_output=True,
                          text=True, timeout=120)


def test_report_reads_each_variants_own_keys_and_trend(tmp_path):
    reward = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    _write(tmp_path / "grpo.jsonl", [{"traj_reward/mean": r, "actor/num_optimizer_steps": 4.0,
                                      "traj_plan/split_trajectories": 0.0} for r in reward])
    _write(tmp_path / "stock.jsonl", [{"traj_reward/mean": r / 2, "stock_plan/expected_optimizer_steps": 12.0,
                                       "stock_plan/split_trajectories": 5.0} for r in reward])
    run = _compare("--out", str(tmp_path), "--report-only", "--variant", "grpo=", "--variant",
                   "stock=traj.enable=false")
    assert run.returncode == 0, run.stderr
    table = (tmp_path / "compare.md").read_text()
    assert "| mean reward per trajectory | 0.35 (0.15 → 0.55) | 0.175 (0.075 → 0.275) |" in table
    assert "| optimizer steps per step | 4 (4 → 4) | 12 (12 → 12) |" in table
    assert "| trajectories split over mini-batches | 0 (0 → 0) | 5 (5 → 5) |" in table
    assert (tmp_path / "compare.png").stat().st_size > 0
    runs = json.loads((tmp_path / "compare.json").read_text())["runs"]
    assert runs["stock"]["overrides"] == ["traj.enable=false"] and len(runs["grpo"]["metrics"]) == 6


def test_a_bad_variant_or_missing_run_names_the_fix(tmp_path):
    bad = _compare("--out", str(tmp_path), "--report-only", "--variant", "no name")
    assert bad.returncode != 0 and "expected NAME=[@CONFIG] [OVERRIDES]" in bad.stderr
    missing = _compare("--out", str(tmp_path), "--report-only", "--variant", "grpo=")
    assert missing.returncode != 0 and "run without --report-only first" in missing.stderr


def test_over_seeds_the_report_gives_each_seeds_trend_the_mean_and_the_spread(tmp_path):
    rewards = {0: [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], 1: [0.2, 0.2, 0.3, 0.3, 0.4, 0.4], 2: [0.3, 0.1, 0.4, 0.2, 0.5, 0.3]}
    for seed, series in rewards.items():
        _write(tmp_path / f"grpo.s{seed}.jsonl", [{"traj_reward/mean": r, "perf/total_num_tokens": 100.0,
                                                   "timing_s/step": 2.0} for r in series])
    run = _compare("--out", str(tmp_path), "--report-only", "--seeds", "0,1,2", "--variant", "grpo=")
    assert run.returncode == 0, run.stderr
    table = (tmp_path / "compare.md").read_text()
    # first third -> last third per seed: 0.15 -> 0.55 (+0.4), 0.2 -> 0.4 (+0.2), 0.2 -> 0.4 (+0.2)
    assert "| mean reward per trajectory | 0.1833 → 0.45 (+0.267; seeds +0.4, +0.2, +0.2) |" in table
    assert "| 2 | 0.167 [0.100, 0.200] |" in table  # step 2 over the three seeds
    assert "trend +0.267, each seed +0.400, +0.200, +0.200; the seeds' trends span 0.200" in table
    assert (tmp_path / "compare.png").stat().st_size > 0
    assert set(json.loads((tmp_path / "compare.json").read_text())["runs"]["grpo"]["metrics_by_seed"]) == {"0", "1", "2"}
    bad = _compare("--out", str(tmp_path), "--report-only", "--seeds", "0,x", "--variant", "grpo=")
    assert bad.returncode != 0 and "comma-separated integers" in bad.stderr


def test_over_seeds_the_report_compares_variants_at_equal_tokens_and_wall_clock(tmp_path):
    """The cheap variant, listed second (2 and 3 s a step over its two seeds, 100 tokens), sets the budget from the
    mean over its seeds (15 s, 600 tokens over 6 steps): its seed 1 is cut at 5 steps. The dear one (4 and 5 s, 300
    tokens) is cut at 3 and 3 steps for wall-clock and at 2 for tokens; the reward is the last third of those steps."""
    cheap, dear = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.3, 0.5, 0.7, 0.8, 0.9, 1.0]
    for seed in (0, 1):
        _write(tmp_path / f"stock.s{seed}.jsonl", [{"traj_reward/mean": r, "perf/total_num_tokens": 300.0,
                                                    "timing_s/step": 4.0 + seed} for r in dear])
        _write(tmp_path / f"grpo.s{seed}.jsonl", [{"traj_reward/mean": r + seed / 10, "perf/total_num_tokens": 100.0,
                                                   "timing_s/step": 2.0 + seed} for r in cheap])
    args = ("--out", str(tmp_path), "--report-only", "--seeds", "0,1", "--variant", "stock=traj.enable=false",
            "--variant", "grpo=")
    run = _compare(*args)
    assert run.returncode == 0, run.stderr
    table = (tmp_path / "compare.md").read_text()
    # tokens: stock 2 steps (0.5 both seeds); grpo whole: steps 5-6, 0.55 and 0.65
    assert ("at equal tokens trained (600: grpo's total, mean of its seeds): stock 2-2 steps, last third 0.500; "
            "grpo 6-6 steps, last third 0.600") in table
    # wall-clock 15 s: stock 3 steps at 4 s and 5 s (step 3: 0.7); grpo seed 0 6 steps (0.55), seed 1 5 steps at 3 s
    # (last third of 5 = step 5: 0.6)
    assert ("at equal wall-clock (15 s: grpo's total, mean of its seeds): stock 3-3 steps, last third 0.700; "
            "grpo 5-6 steps, last third 0.575") in table
    rows = [{"traj_reward/mean": r, "timing_s/step": 4.0} for r in dear]  # a seed that logged no tokens
    _write(tmp_path / "stock.s1.jsonl", rows)
    assert _compare(*args).returncode == 0
    table = (tmp_path / "compare.md").read_text()
    assert ("at equal tokens trained: not compared (perf/total_num_tokens missing or not finite in stock seed 1)"
            in table)
    assert "at equal wall-clock (15 s: grpo's total" in table
