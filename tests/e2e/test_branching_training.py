"""docs/branching.md's example as a user runs it: an agent whose sessions fork (best-of-N from a mid-state) and spawn a
checker sub-agent in a fresh context (``examples/branching_agent``), each leaf scored on its own, trained through
``python -m verl_traj.main_ppo`` on both trainers: each session one call tree, its rows the tree's path decomposition,
its calls credited from their leaves."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.e2e.runs import TRAINERS, V0_OPT_IN, launch, tail

pytestmark = pytest.mark.e2e
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "branching_agent"
BRANCHES = 2  # examples/branching_agent/branch_loop.py


def _run(home, tmp_path, trainer: str, *extra: str):
    pythonpath = os.pathsep.join(filter(None, [str(EXAMPLE), os.environ.get("PYTHONPATH")]))
    return launch(home, tmp_path, [
        *TRAINERS[trainer], f"actor_rollout_ref.rollout.agent.agent_loop_config_path={EXAMPLE / 'agent_loops.yaml'}",
        "actor_rollout_ref.rollout.agent.default_agent_loop=best_of_n", "traj.step_wise=true",
        "data.max_response_length=64", f"reward.custom_reward_function.path={EXAMPLE / 'reward.py'}",
        "trainer.total_training_steps=2", *extra], extra_env={"PYTHONPATH": pythonpath})


# the v0 run is a repeat on the deprecated trainer (opt in, as runs.py's other v0 repeats: the suite's time budget);
# v0's expansion, planning, tree credit and loss on trees are unit-tested through its _balance_batch
@pytest.mark.parametrize("trainer,weighting", [("v1", "once"), pytest.param("v0", "paths", marks=V0_OPT_IN)])
def test_a_branching_agent_trains_as_call_trees(tiny_home, tmp_path, trainer, weighting):
    """v1 as shipped (each distinct token once); v0 with ``traj.branch_weighting=paths``, the peers' layout (each
    root-to-leaf path its own rows: here as many rows, the first call trained once per branch)."""
    run = _run(tiny_home, tmp_path, trainer, f"traj.branch_weighting={weighting}")
    assert run.returncode == 0, tail(run.output, 80)
    assert len(run.metrics) == 2, tail(run.output, 40)
    for m in run.metrics:
        sessions = m["traj_stepwise/trajectories"]
        assert m["traj_stepwise/rows_before"] == sessions * (2 + BRANCHES)  # the first call, each branch, the checker
        assert m["traj_stepwise/rows_after"] == sessions * (1 + BRANCHES)  # a row per branch (the first continues
        # the first call's row, or each path has its own) and one for the checker's fresh context
        assert m["traj_tree/leaves_mean"] == BRANCHES + 1 and m["traj_tree/leaves_max"] == BRANCHES + 1
        assert m["traj_plan/split_groups"] == 0
        assert m["training/rollout_probs_diff_max"] < 1e-5  # each row's tokens are its calls' own
    split = [m["traj_tree/split_tokens"] for m in run.metrics]
    if weighting == "paths":  # every copy its own path's leaf: nothing to split
        assert not any(split) and not any("actor/tree_split_tokens" in m for m in run.metrics)
        return
    # calls above leaves of both signs (the first call, under per-leaf outcomes) trained with the two-part loss: the
    # part reaches the actor's loss (v1: put in TransferQueue with the advantages)
    assert any(split), split
    for m, s in zip(run.metrics, split):
        assert (m.get("actor/tree_split_tokens", 0) > 0) == (s > 0), (m.get("actor/tree_split_tokens"), s)

def test_tree_grpo_with_expanded_weighting_trains_on_two_ranks(tiny_home, tmp_path):
    """``algorithm.adv_estimator=tree_grpo traj.branch_weighting=expanded`` (v1) on two data-parallel ranks: the first
    call trains for its ``BRANCHES`` paths; the loss's normaliser counts those copies over both ranks (the weighted
    token mass of each optimizer step is 1 under token-mean), and the copies and the two-sign part reach each rank's
    loss through TransferQueue."""
    run = _run(tiny_home, tmp_path, "v1", "algorithm.adv_estimator=tree_grpo", "traj.branch_weighting=expanded",
               "trainer.n_gpus_per_node=2")
    assert run.returncode == 0, tail(run.output, 80)
    assert len(run.metrics) == 2, tail(run.output, 40)
    for m in run.metrics:
        assert m["actor/loss_weight_mass"] == pytest.approx(1.0, abs=1e-5)
        assert m["traj_tree/leaves_mean"] == BRANCHES + 1
    assert any(m.get("actor/tree_split_tokens", 0) > 0 for m in run.metrics)
