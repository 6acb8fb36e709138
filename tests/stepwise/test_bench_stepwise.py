"""Smoke test of scripts/bench_stepwise.py on the first trajectories of the shared data."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(os.path.dirname(ROOT), "shared", "data", "swebench_steps.jsonl")  # ../shared beside the repo


@pytest.mark.skipif(not os.path.exists(DATA), reason="shared benchmark data not present")
@pytest.mark.parametrize("extra", [[], ["--retokenise-prob", "0.3", "--planner", "model"]])
def test_bench_json(extra):
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_stepwise.py"), "--limit", "16", "--json", *extra],
        capture_output=True, text=True, check=True, timeout=300,
    )
    res = json.loads(out.stdout)
    assert res["loss_tokens_identical"] and res["loss_tokens_stepwise"] == res["loss_tokens_merged"] > 0
    assert res["rows_merged"] <= res["rows_stepwise"] and res["tokens_merged"] < res["tokens_stepwise"]
    if not extra:
        assert res["rows_merged"] == 16  # append-only conversations: one row per trajectory
    assert res["planned_update_workload_merged"] < res["planned_update_workload_stepwise"]
