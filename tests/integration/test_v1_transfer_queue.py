"""The v1 adapter against a real TransferQueue (Ray + TQ controller + storage, in this process): rows stored as
verl's v1 agent-loop worker stores them, ``TrajV1Mixin._balance_batch`` on verl's sync trainer class, then what the
workers would pull. Checks the dispatch order (rank-major, equal blocks), padding rows stored with the rows'
schema (so every field stays common to the batch and reaches the workers), the plan's fields on every row, whole
trajectories and groups per mini-batch, and the loss weights (each mini-batch's real loss tokens weigh 1)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl_traj.config import TrajConfig
from verl_traj.core.keys import LOSS_WEIGHT, MICRO_BATCH_ID, MINI_BATCH_ID
from verl_traj.integration.verl_config import PlanSettings
from verl_traj.testing.trainers import ray_less_trainer

pytestmark = pytest.mark.e2e

DP, MINI, N = 2, 2, 3  # 4 prompts x 3 sessions, mini-batches of 2 prompts, 2 ranks


@pytest.fixture(scope="module")
def tq():
    import ray
    import transfer_queue

    # address="local": never join a cluster some earlier job left recorded on the machine (see test_ray_start.py)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    transfer_queue.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1,
                                                                        "total_storage_size": 10000}}}))
    yield transfer_queue
    transfer_queue.close()
    ray.shutdown()


def _store_rows(tq, rng, prefix="u"):
    """Agent-loop outputs of 4 prompts x 3 sessions x 1-3 steps, as ``AgentLoopWorkerTQ`` stores them."""
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    keys, fields, tags = [], [], []
    for g in range(4):
        for s in range(N):
            for k in range(int(rng.integers(1, 4))):
                p, r = int(rng.integers(3, 9)), int(rng.integers(2, 7))
                mask = torch.ones(r, dtype=torch.int64)
                mask[: int(rng.integers(0, r))] = 0
                ids = torch.randint(3, 50, (p + r,))
                keys.append(f"{prefix}{g}_{s}_{k}")
                fields.append({"prompts": ids[:p], "responses": ids[p:], "input_ids": ids, "response_mask": mask,
                               "loss_mask": mask, "position_ids": torch.arange(p + r), "uid": f"{prefix}{g}",
                               "session_id": s, "rm_scores": torch.zeros(r), "num_turns": 2})
                tags.append({"status": "success", "prompt_len": p, "response_len": r, "seq_len": p + r,
                             "global_steps": 1, "min_global_steps": 0, "max_global_steps": 0})
    order = rng.permutation(len(keys))  # the replay buffer returns rows in completion order
    keys, fields, tags = [keys[i] for i in order], [fields[i] for i in order], [tags[i] for i in order]
    tq.kv_batch_put(keys=keys, partition_id="train", fields=list_of_dict_to_tensordict(fields), tags=tags)
    from transfer_queue import KVBatchMeta

    return KVBatchMeta(keys=keys, tags=tags, partition_id="train")


def _trainer():
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from verl_traj.integration.v1 import traj_trainer_class

    return ray_less_trainer({"data": {"train_batch_size": 4, "max_response_length": 8},
                             "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": MINI, "ppo_epochs": 1}}},
                            TrajConfig(), plan=PlanSettings(max_tokens=24, cost="tokens", derived=True, pad_row_tokens=2),
                            dp=DP, v1_class=PPOTrainerSync)


def test_planned_batch_in_transfer_queue(tq):
    batch = _store_rows(tq, np.random.default_rng(0))
    tr, metrics = _trainer(), {}
    out = tr._balance_batch(batch, metrics)
    n = len(out)
    assert n % DP == 0 and metrics["traj_plan/split_groups"] == 0 and metrics["traj_plan/split_trajectories"] == 0
    assert set(out.keys) >= set(batch.keys) and n - len(batch) == metrics["traj_plan/padding_rows"]

    stored = tq.kv_batch_get(keys=out.keys, partition_id="train")  # what a worker pulls: every common field
    assert {MINI_BATCH_ID, MICRO_BATCH_ID, "input_ids", "response_mask", "rm_scores", "uid"} <= set(stored.keys())
    mb = stored[MINI_BATCH_ID]
    for rank in range(DP):  # dispatch hands rank r the r-th block: mini-batches in order within it
        block = mb[rank * n // DP:(rank + 1) * n // DP]
        assert torch.equal(block, torch.sort(block).values)
    pad = torch.tensor([bool(t.get("is_padding")) for t in out.tags])
    assert torch.equal(pad, tr._planned.is_padding)
    assert pad.any() and stored["input_ids"].offsets().diff()[pad].tolist() == [2] * int(pad.sum())
    for key_set in ({k.rsplit("_", 2)[0] for k in out.keys}, {k.rsplit("_", 1)[0] for k in out.keys}):
        for unit in key_set:  # groups, trajectories: one mini-batch each
            ids = {int(m) for k, m in zip(out.keys, mb) if k.startswith(unit + "_")}
            assert len(ids) == 1 or unit.startswith("pad")

    tr._put_loss_weights(out, tr.spec.actor_loss)
    w = tq.kv_batch_get(keys=out.keys, partition_id="train", select_fields=[LOSS_WEIGHT, "response_mask"])
    loss_tokens = w["response_mask"].to_padded_tensor(0).sum(-1).double()
    per_mb = torch.zeros(int(mb.max()) + 1, dtype=torch.float64).index_add_(0, mb, w[LOSS_WEIGHT].double() * loss_tokens)
    torch.testing.assert_close(per_mb, torch.ones_like(per_mb))
    assert torch.all(w[LOSS_WEIGHT][pad] == 0)


def test_a_step_of_several_local_updates_reads_every_plans_padding(tq):
    """Regression: with parameter_sync_step > 1 one global step plans several local updates and v1 hands
    _compute_metrics the step's whole batch (every update's rows); the metrics' real-row mask must come from every
    plan of the step, not from the last one (which raised on the keys of the earlier updates)."""
    first = _store_rows(tq, np.random.default_rng(1), prefix="a")
    second = _store_rows(tq, np.random.default_rng(2), prefix="b")
    tr = _trainer()
    outs = [tr._balance_batch(b, {}) for b in (first, second)]
    keys = outs[0].keys + outs[1].keys
    real = tr._real_rows_of_step(keys)
    expected = [not k.startswith("pad") for k in keys]
    assert real.tolist() == expected and not all(expected)  # padding rows of both updates found
    with pytest.raises(RuntimeError, match="not planned"):
        tr._real_rows_of_step(keys)  # forgotten after the step's metrics
