"""The plan on the real SWE-bench step lengths (500 trajectories, 20,163 step rows)."""

from __future__ import annotations

import pytest

from tests.core.plan_checks import check_plan
from verl_traj.core import plan_mini_batches
from verl_traj.testing import swebench_batch
from verl_traj.testing.swebench import DATA_FILE

pytestmark = pytest.mark.skipif(
    not DATA_FILE.exists(), reason=f"real data file {DATA_FILE} is absent (it lives in ../shared beside the repo)"
)


@pytest.fixture(scope="module")
def swe():
    b = swebench_batch()
    return b, b.layout()


def test_real_data_shape(swe):
    b, lay = swe
    assert lay.num_rows == 20_163 and lay.num_trajectories == 500
    assert int(lay.traj_num_steps.max()) == 145
    assert 4.5e6 < int(lay.num_loss_tokens.sum()) < 4.7e6


@pytest.mark.parametrize("group_by, M, dp", [("group", 4, 8), ("trajectory", 16, 8), ("trajectory", 8, 4), ("group", 12, 2)])
def test_real_data_plan(swe, group_by, M, dp):
    b, lay = swe
    plan = plan_mini_batches(lay, M, dp, group_by=group_by, micro_batch_max_tokens=131_072)
    check_plan(b, lay, plan, M, dp, group_by, "verl", 131_072)
    m = plan.metrics()
    assert m["traj_plan/split_trajectories"] == 0
    # the 5% goal on the real data
    assert m["traj_plan/balance_ratio_worst"] <= 1.05, m
    assert m["traj_plan/padding_rows"] <= M * (dp - 1)
