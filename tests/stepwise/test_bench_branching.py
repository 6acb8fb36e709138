"""``scripts/bench_branching.py``'s token report on SWE-bench-length branching sessions (the shared data; skipped
without it): the tree layout trains each call's tokens once where the peers' path layout trains shared calls once per
path, the chain recording (before issue 56) breaks interleaved branches into more rows, and every layout's rows
forward the same distinct tokens as prefix trees."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reports() -> dict:
    if not (ROOT.parent / "shared" / "data" / "swebench_steps.jsonl").exists():
        pytest.skip("shared benchmark data not present")
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bench_branching
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return {layout: bench_branching.token_report(layout, 4, 2, 0, 1000, 64) for layout in bench_branching.LAYOUTS}


def test_each_layout_trains_and_forwards_what_it_should(reports):
    tree, paths, chain = reports["tree"], reports["paths"], reports["chain"]
    assert tree["calls"] == paths["calls"] == chain["calls"] and tree["calls"] >= 8 * 4
    assert tree["loss_tokens"] == chain["loss_tokens"] < paths["loss_tokens"]  # each call once / once per path
    assert chain["rows"] > tree["rows"] and chain["row_tokens"] > tree["row_tokens"]  # interleaved branches break it
    assert tree["tree_tokens"] == paths["tree_tokens"] == chain["tree_tokens"] < tree["row_tokens"]
