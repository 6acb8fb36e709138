"""End-to-end CPU training through ``python -m verl_traj.main_ppo`` (real verl: Ray, FSDP2 engine
workers, CPU rollout server) with verl_traj's trainer and workers, on both of verl's trainers (v1, the default,
and v0): the same checks hold on each.

Observed through verl's file logger (metrics per step) and the trainer's debug dump
(``VERL_TRAJ_DEBUG_DUMP``: per step, every row's uid, mini_batch_id, is_padding, lengths):

* every GRPO group's (and trajectory's) rows carry one ``mini_batch_id``;
* the workers ran exactly ``train_batch_size // ppo_mini_batch_size * ppo_epochs`` optimizer steps
  per training step (``actor/num_optimizer_steps``, counted in ``TrajTrainingWorker``) and exactly the
  planned micro-batches (``actor/micro_batches_per_epoch`` == ``traj_plan/micro_batches``);
* the data metrics exclude padding rows (``response_length/mean`` equals the mean over real rows
  and differs from the mean over all rows when the plan added padding).
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from tests.e2e.runs import (DP2_CAP, DP2_CONFIG, ONE_RANK_CONFIG, TRAINERS, TRAINERS_V0_OPT_IN, dp2_reference,
                           one_rank_ppo, tail)

pytestmark = pytest.mark.e2e

STEPS = 2


def _dump(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _check_run(run, dump_path, *, mini_batches: int, epochs: int = 1, expect_padding: bool, steps: int = STEPS):
    assert run.returncode == 0, tail(run.output, 80)
    metrics = [m for m in run.metrics if "actor/num_optimizer_steps" in m]
    assert len(metrics) == steps, f"expected {steps} logged steps, got {len(metrics)}: {tail(run.output)}"
    records = _dump(dump_path)
    assert len(records) == steps
    saw_padding = False
    for m, rec in zip(metrics, records):
        # one optimizer step per configured mini-batch (and epoch), whatever the rows
        assert m["actor/num_optimizer_steps"] == mini_batches * epochs
        assert m["traj_plan/expected_optimizer_steps"] == mini_batches * epochs
        assert m["traj_plan/num_mini_batches"] == mini_batches
        assert m["traj_plan/split_groups"] == 0 and m["traj_plan/split_trajectories"] == 0
        # the workers ran exactly the planned micro-batches (per rank, summed over mini-batches, per epoch)
        assert m["actor/micro_batches_per_epoch"] == m["traj_plan/micro_batches"]
        planned = {(mb, mi) for mb, mi, pad in zip(rec["mini_batch_id"], rec["micro_batch_id"], rec["is_padding"])}
        assert len(planned) >= mini_batches
        # every group / trajectory in one mini-batch (checked on the rows actually sent)
        ids_of = defaultdict(set)
        for uid, tid, mb, pad in zip(rec["uid"], rec["traj_id"] or rec["uid"], rec["mini_batch_id"], rec["is_padding"]):
            if not pad:
                ids_of[("uid", uid)].add(mb)
                ids_of[("traj", tid)].add(mb)
        assert ids_of and all(len(v) == 1 for v in ids_of.values())
        assert sorted({mb for mb in rec["mini_batch_id"]}) == list(range(mini_batches))
        # rank-major equal blocks
        assert len(rec["uid"]) % rec["dp_size"] == 0
        # metrics exclude padding
        real = [length for length, pad in zip(rec["response_length"], rec["is_padding"]) if not pad]
        everything = rec["response_length"]
        assert m["response_length/mean"] == pytest.approx(sum(real) / len(real), rel=1e-5)
        n_pad = sum(rec["is_padding"])
        assert m["traj_plan/padding_rows"] == n_pad
        if n_pad:
            saw_padding = True
            assert m["response_length/mean"] != pytest.approx(sum(everything) / len(everything), rel=1e-5)
    if expect_padding:
        assert saw_padding, "the plan was expected to add padding rows"


@pytest.mark.parametrize("trainer", TRAINERS_V0_OPT_IN)
def test_traj_training_one_rank(shared_run, trainer):
    """The shared one-rank PPO run (``one_rank_ppo``): the plan's invariants with a critic and 2 actor epochs."""
    run = shared_run(one_rank_ppo(trainer, STEPS), config_name=ONE_RANK_CONFIG)
    # cpu_tiny_ppo: train_batch_size 8 / ppo_mini_batch_size 4 = 2 mini-batches, 2 epochs
    _check_run(run, run.workdir / "dump" / "plan.jsonl", mini_batches=2, epochs=2, expect_padding=False)


@pytest.mark.parametrize("trainer", TRAINERS_V0_OPT_IN)  # v0 on two ranks by default: tests/e2e/test_stepwise_training.py
def test_traj_training_two_ranks_padding_token_cap(shared_run, trainer):
    """dp=2, groups of 3 rows, 3 groups per mini-batch -> 9 rows per mini-batch -> a padding row each;
    the token cap cuts several micro-batches per rank (the shared ``dp2_reference`` run, on verl's remove-padding
    path: the planner's token-sum cost model packs the fewest micro-batches, and actor and critic run exactly those)."""
    run = shared_run(dp2_reference(trainer), config_name=DP2_CONFIG)
    _check_run(run, run.workdir / "dump" / "plan.jsonl", mini_batches=2, expect_padding=True, steps=3)
    for m in run.metrics:
        if "traj_plan/micro_batches" in m:
            assert m["traj_plan/max_packed_tokens"] <= DP2_CAP
            assert m["traj_plan/micro_batches"] > 2 and m["actor/micro_batches_per_epoch"] == m["traj_plan/micro_batches"]
            assert m["critic/micro_batches_per_epoch"] == m["traj_plan/micro_batches"]
    for rec in _dump(run.workdir / "dump" / "plan.jsonl"):
        _check_fewest_micro_batches(rec, DP2_CAP)


def _fewest_bins(sizes: list[int], cap: int) -> int:
    """The fewest bins of capacity ``cap`` that hold ``sizes`` (exhaustive: a rank's rows of one mini-batch)."""
    import itertools

    for k in range(1, len(sizes) + 1):
        for assignment in itertools.product(range(k), repeat=len(sizes)):
            loads = [0] * k
            for size, b in zip(sizes, assignment):
                loads[b] += size
            if max(loads) <= cap:
                return k
    return len(sizes)


def _check_fewest_micro_batches(rec: dict, cap: int) -> None:
    """Remove-padding: a micro-batch costs its token sum, so the plan runs the fewest micro-batches under the cap on
    the rank that needs most (ranks of one mini-batch run the same count), padding rows' tokens included."""
    per_rank = len(rec["uid"]) // rec["dp_size"]
    sizes, micro = defaultdict(list), defaultdict(set)
    for i, (mb, mi, n) in enumerate(zip(rec["mini_batch_id"], rec["micro_batch_id"], rec["attention_length"])):
        sizes[(i // per_rank, mb)].append(n)
        micro[(i // per_rank, mb)].add(mi)
    for mb in set(rec["mini_batch_id"]):
        ranks = range(rec["dp_size"])
        fewest = max(_fewest_bins(sizes[(r, mb)], cap) for r in ranks)
        assert all(len(micro[(r, mb)]) == fewest for r in ranks), (mb, fewest, [len(micro[(r, mb)]) for r in ranks])


@pytest.mark.parametrize("trainer", TRAINERS_V0_OPT_IN)
def test_traj_disabled_is_stock_verl(run_training, tmp_path, trainer):
    """traj.enable=false through the same entry point: verl's own balancing and fixed-size
    mini-batches (no plan, no verl_traj worker metrics); ``stock_plan/*`` observes them."""
    dump = tmp_path / "dump"
    run = run_training(
        [*TRAINERS[trainer], f"trainer.total_training_steps={STEPS}", "traj.enable=false"],
        timeout=420,
        extra_env={"VERL_TRAJ_DEBUG_DUMP": str(dump)},
    )
    assert run.returncode == 0, tail(run.output, 80)
    steps = [m for m in run.metrics if "actor/pg_loss" in m]
    assert len(steps) == STEPS
    for m in steps:
        assert "global_seqlen/min" in m  # verl's stock _balance_batch ran
        assert not any(k.startswith("traj_plan/") for k in m)
        assert m["stock_plan/num_mini_batches"] == 2  # cpu_tiny: 8 prompts / 4 per mini-batch
        assert "actor/num_optimizer_steps" not in m
    assert not (dump / "plan.jsonl").exists()
