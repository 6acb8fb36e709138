"""Prefix trees through ``python -m verl_traj.main_ppo`` (issue 29), as the default takes them (``traj.prefix_tree:
auto``, which the CPU presets' remove-padding path settles to trees: issue 41): real verl PPO (GAE, a critic, a
reference model with KL loss) on two CPU ranks, a token cap, one mini-batch of 6 prompt groups x 3 rows per step, side
by side with the same run on the row forward (``traj.prefix_tree=false``, the override a user compares with); GRPO on
v0 (opt-in), Ulysses, and step rows with GSPO likewise.

What the pair shows:
* the tree is exact: the first step's old-log-prob entropy, rollout-vs-actor log-prob gap and gradient norm equal the
  row forward's (the rollout and everything before the update are the same);
* both log-probs of the PPO ratio take one numeric path: with one mini-batch and one epoch the update's log-probs are
  the old ones at the same parameters, so ``actor/ppo_kl`` is rounding on every step (the divergence others saw came
  from these two taking different paths);
* the trees ran where the plan said: every planned micro-batch of the update and of the old-log-prob pass ran as a
  tree (the workers raise otherwise), each group whole on one rank in one micro-batch, fewer tokens than rows.

The critic's value pass and update and the reference pass run on trees too: step 1's values, advantages, value loss
and both gradient norms equal the row forward's, also under Ulysses sequence parallelism of 2.
"""

from __future__ import annotations

import pytest

from tests.e2e.runs import TRAINERS, ULYSSES_2, V0_OPT_IN

pytestmark = pytest.mark.e2e

PAIR = [*TRAINERS["v1"], "trainer.total_training_steps=2", "trainer.n_gpus_per_node=2",
        "data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=6", "actor_rollout_ref.rollout.n=3",
        "traj.micro_batch_max_tokens=200"]


PPO = ["critic.ppo_mini_batch_size=6"]


def _pair(shared_run, overrides, config_name="cpu_tiny"):
    """The run as a user types it (``traj.prefix_tree`` left at its default, ``auto``: trees on the CPU presets) and
    the same run on rows (``traj.prefix_tree=false``), keyed True / False."""
    runs = {True: shared_run(overrides, config_name=config_name),
            False: shared_run([*overrides, "traj.prefix_tree=false"], config_name=config_name)}
    for tree, run in runs.items():
        assert run.returncode == 0, f"prefix_tree={'auto' if tree else 'false'}:\n{run.tail()}"
        assert len(run.metrics) == 2
    assert "traj.prefix_tree=auto: prefix trees" in runs[True].output  # start-up said which it chose
    return runs


@pytest.fixture(scope="module")
def v0_pair(shared_run):
    return _pair(shared_run, [*TRAINERS["v0"], *PAIR[1:]])


@pytest.fixture(scope="module")
def ulysses_pair(shared_run):
    """PPO on one data-parallel rank of two Ulysses ranks: every model's sequence split over both, the tree attention
    after verl's all-to-all (the whole tree per head group)."""
    return _pair(shared_run, list(dict.fromkeys([*PAIR, *PPO, *ULYSSES_2])), config_name="cpu_tiny_ppo")


@pytest.fixture(scope="module")
def ppo_pair(shared_run):
    return _pair(shared_run, [*PAIR, *PPO], config_name="cpu_tiny_ppo")


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.fixture(params=["v1", pytest.param("v0", marks=V0_OPT_IN)])
def grpo_pair(request):
    """v1: the PPO pair (its actor is GRPO's plus a KL loss: one launch serves both checks); v0: GRPO, opt-in."""
    return request.getfixturevalue("ppo_pair" if request.param == "v1" else "v0_pair")


def test_first_step_on_trees_equals_the_row_forward(grpo_pair):
    tree, rows = grpo_pair[True].metrics[0], grpo_pair[False].metrics[0]
    assert _rel(tree["actor/grad_norm"], rows["actor/grad_norm"]) < 1e-5
    assert _rel(tree["actor/entropy"], rows["actor/entropy"]) < 1e-6
    assert tree["training/rollout_probs_diff_max"] < 1e-6
    assert abs(tree["actor/pg_loss"] - rows["actor/pg_loss"]) < 1e-6


def test_old_and_update_log_probs_take_one_path_on_every_step(grpo_pair):
    for step in grpo_pair[True].metrics:
        assert abs(step["actor/ppo_kl"]) < 1e-7
        assert step["actor/pg_clipfrac"] == 0.0


def test_every_planned_micro_batch_ran_as_a_tree(grpo_pair):
    for step in grpo_pair[True].metrics:
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
        assert 0 < step["actor/tree_attention_pairs"] < step["actor/tree_row_attention_pairs"]
        assert step["actor/tree_share"] == 1.0
    rows = grpo_pair[False].metrics[0]
    assert rows["actor/tree_share"] == 0.0 and not any(k.startswith("actor/tree_") for k in rows if k != "actor/tree_share")


@pytest.fixture(params=["dp2", "ulysses2"])
def ppo_pairs(request):
    return request.getfixturevalue("ppo_pair" if request.param == "dp2" else "ulysses_pair")


def test_ppo_first_step_on_trees_equals_the_row_forward(ppo_pairs):
    tree, rows = ppo_pairs[True].metrics[0], ppo_pairs[False].metrics[0]
    for key in ("critic/values/mean", "critic/values/max", "critic/advantages/max", "critic/advantages/min",
                "critic/vf_loss", "critic/grad_norm", "actor/grad_norm", "actor/entropy"):
        assert _rel(tree[key], rows[key]) < 1e-5, (key, tree[key], rows[key])
    assert abs(tree["actor/kl_loss"] - rows["actor/kl_loss"]) < 1e-7  # the reference pass on trees
    for step in ppo_pairs[True].metrics:
        planned = step["traj_plan/micro_batches"]
        assert step["critic/tree_micro_batches"] == planned == step["actor/tree_micro_batches"]
        assert step["critic/tree_infer_micro_batches"] == planned  # the value pass
        assert step["critic/tree_tokens"] == step["actor/tree_tokens"] <= step["traj_plan/tree_tokens"]
        assert abs(step["actor/ppo_kl"]) < 1e-7


def test_step_rows_and_gspo_over_the_trajectory_on_trees(gspo_step_rows):
    """Unmerged step rows (every row of a trajectory repeats its earlier turns) with GSPO at trajectory scope, one
    mini-batch for two epochs, on the default path (trees) and on rows: the same gradient norm and loss; each
    trajectory atomic, its rows one tree (fewer tokens than rows). On rows, epoch 2 runs GSPO's no-grad pre-pass (a
    trajectory's rows may sit in several micro-batches); on trees every trajectory is in one micro-batch, so the loss
    takes each trajectory's ratio from the live log-probs: no pre-pass, the same gradient."""
    runs = {True: gspo_step_rows(False), False: gspo_step_rows(False, "false")}
    tree, rows = runs[True], runs[False]
    assert tree["traj_stepwise/rows_after"] > tree["traj_stepwise/trajectories"]  # multi-row trajectories
    assert tree["traj_stepwise/loss_tokens"] == rows["traj_stepwise/loss_tokens"]  # the same rollouts
    assert _rel(tree["actor/grad_norm"], rows["actor/grad_norm"]) < 1e-5
    assert tree["actor/pg_loss"] == pytest.approx(rows["actor/pg_loss"], rel=1e-5, abs=1e-8)
    assert tree["traj_plan/atomic_trajectory_share"] == 1.0
    assert tree["traj_plan/row_tokens_per_tree_token"] > 1.2
    planned = tree["traj_plan/micro_batches"]
    assert rows["actor/prepass_micro_batches_per_epoch"] == rows["traj_plan/micro_batches"] / 2  # epoch 2, on rows
    assert tree["actor/prepass_micro_batches_per_epoch"] == 0 and tree["actor/ratio_in_loss"] == 1.0
    assert tree["actor/traj_seq_ratio_shift_abs_max"] > 1e-4  # epoch 2: the trajectory's ratio is not a row's
    assert tree["actor/tree_micro_batches"] == 2 * planned  # two epochs, no pre-pass
    assert tree["actor/tree_infer_micro_batches"] == planned
    assert tree["actor/tree_share"] == 1.0 and rows["actor/tree_share"] == 0.0
