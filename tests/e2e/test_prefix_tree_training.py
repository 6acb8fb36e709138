"""``traj.prefix_tree=true`` through ``python -m verl_traj.main_ppo`` (issue 29): real verl GRPO on two CPU ranks,
remove-padding, a token cap, one mini-batch of 6 prompt groups x 3 rows per step, side by side with the same run on
the row forward (``traj.prefix_tree=false``, the override a user compares with).

What the pair shows:
* the tree is exact: the first step's old-log-prob entropy, rollout-vs-actor log-prob gap and gradient norm equal the
  row forward's (the rollout and everything before the update are the same);
* both log-probs of the PPO ratio take one numeric path: with one mini-batch and one epoch the update's log-probs are
  the old ones at the same parameters, so ``actor/ppo_kl`` is rounding on every step (the divergence others saw came
  from these two taking different paths);
* the trees ran where the plan said: every planned micro-batch of the update and of the old-log-prob pass ran as a
  tree (the workers raise otherwise), each group whole on one rank in one micro-batch, fewer tokens than rows.
"""

from __future__ import annotations

import pytest

from tests.e2e.runs import REMOVE_PADDING, TRAINERS

pytestmark = pytest.mark.e2e

PAIR = [*TRAINERS["v1"], "trainer.total_training_steps=2", *REMOVE_PADDING, "trainer.n_gpus_per_node=2",
        "data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=6", "actor_rollout_ref.rollout.n=3",
        "traj.micro_batch_max_tokens=200"]


@pytest.fixture(scope="module")
def pair(shared_run):
    runs = {tree: shared_run([*PAIR, f"traj.prefix_tree={str(tree).lower()}"]) for tree in (True, False)}
    for tree, run in runs.items():
        assert run.returncode == 0, f"prefix_tree={tree}:\n{run.tail()}"
        assert len(run.metrics) == 2
    return runs


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def test_first_step_on_trees_equals_the_row_forward(pair):
    tree, rows = pair[True].metrics[0], pair[False].metrics[0]
    assert _rel(tree["actor/grad_norm"], rows["actor/grad_norm"]) < 1e-5
    assert _rel(tree["actor/entropy"], rows["actor/entropy"]) < 1e-6
    assert tree["training/rollout_probs_diff_max"] < 1e-6
    assert abs(tree["actor/pg_loss"] - rows["actor/pg_loss"]) < 1e-6


def test_old_and_update_log_probs_take_one_path_on_every_step(pair):
    for step in pair[True].metrics:
        assert abs(step["actor/ppo_kl"]) < 1e-7
        assert step["actor/pg_clipfrac"] == 0.0


def test_every_planned_micro_batch_ran_as_a_tree(pair):
    for step in pair[True].metrics:
        planned = step["traj_plan/micro_batches"]  # per rank, this one mini-batch
        assert step["actor/tree_micro_batches"] == planned == step["actor/micro_batches_per_epoch"]
        assert step["actor/tree_infer_micro_batches"] == planned  # the old-log-prob pass (GRPO: no reference pass)
        assert step["traj_plan/atomic_trajectory_share"] == 1.0
        assert step["traj_plan/row_tokens_per_tree_token"] > 1.5  # 3 rows behind each ~50-token prompt
        # summed over both ranks: the trees hold at most what the plan counted (groups may share the start of their
        # chat template too), the rows are the plan's rows
        assert step["actor/tree_tokens"] <= step["traj_plan/tree_tokens"]
        assert step["actor/tree_row_tokens"] == step["traj_plan/tokens"] + step["traj_plan/padding_tokens"]
        assert step["actor/tree_infer_tokens"] == step["actor/tree_tokens"]  # the same trees in both passes
    assert not any(k.startswith("actor/tree_") for k in pair[False].metrics[0])
