"""``scripts/bench_v1_driver.py --quick --json`` in a subprocess (it starts and stops its own Ray and TransferQueue,
which this process's TransferQueue tests also start): every variant ran on the same stored rows, its phases sum to
its wall time, and the bytes each moved through TransferQueue are what each reads and writes: stock fetches one
whole row (its padding rows' template) and no ``input_ids`` of the batch; verl_traj's plans, rows and trees, read each
row's loss tokens and prefix hashes from the tags the agent loop wrote, so they fetch nothing per row either (issue 55,
item 4), and the tree plan puts the per-token tree facts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ("stock", "traj rows", "traj trees")


@pytest.fixture(scope="module")
def report() -> dict:
    if not (ROOT.parent / "shared" / "data" / "swebench_steps.jsonl").exists():
        pytest.skip("shared benchmark data not present")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_v1_driver.py"), "--quick", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=180,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)


def _results(report: dict) -> dict:
    (size,) = report["sizes"]
    return {x["variant"]: x for x in size["results"]}


def test_every_variant_ran_and_its_phases_sum_to_its_time(report):
    (size,) = report["sizes"]
    results = _results(report)
    assert tuple(results) == VARIANTS and size["rows"] == report["config"]["rows"][0] and size["mean_tokens"] > 1
    for x in results.values():
        assert x["total_s"] > 0 and all(s >= 0 for s in x["phases_s"].values()), x["phases_s"]
        assert sum(x["phases_s"].values()) == pytest.approx(x["total_s"], rel=0.05, abs=0.005)
    assert results["stock"]["vs_stock"] == 1.0
    assert results["stock"]["phases_s"]["read_rows"] == results["traj rows"]["phases_s"]["read_rows"] == 0
    assert results["traj trees"]["phases_s"]["read_rows"] > 0 and results["traj trees"]["phases_s"]["tree_facts"] > 0


def test_the_bytes_each_variant_moves(report):
    rows = report["sizes"][0]["rows"]
    results = _results(report)
    stock, flat, trees = (results[v] for v in VARIANTS)
    # stock: the template of its padding rows (one whole row), its padding rows put, nothing else
    assert set(stock["fetches"]) <= {"*"} and all(f["rows"] == 1 for f in stock["fetches"].values())
    assert stock["padding_rows"] > 0 and stock["put_bytes"] > 0 and set(stock["put_by_phase"]) == {"padding"}
    # verl_traj: the row facts come with the tags: no per-row fetch (only the padding template); nothing put but its
    # padding rows: the plan's fields ship with the calls (one object a rank), never written per row
    for plan in (flat, trees):
        assert set(plan["fetches"]) <= {"*"} and all(f["rows"] == 1 for f in plan["fetches"].values()), plan["fetches"]
        assert set(plan["put_by_phase"]) <= {"padding"} and plan["phases_s"]["ship"] > 0, plan
    assert rows > 1
