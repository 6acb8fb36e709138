"""Padding rows are schema-safe for every consumer after ``_balance_batch``: verl's own reward managers
score them without crashing (their ``reward_model`` / ``extra_info`` / ``data_source`` have a real row's
type and structure) and without touching the real rows' fields, and nothing of their score reaches a
reward, an advantage or a metric (``extract_reward`` / real-row wrappers)."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl.trainer.ppo import ray_trainer as rt

from tests.integration.trainers import fake_trainer

from verl_traj.integration.patches.scoped import fit_patches, patched
from verl_traj.integration.rows import real_rows as R
from verl_traj.testing import as_dataproto, rl_batch

SEEN = []


def reads_everything(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """A custom reward function that uses every per-row field a real one might."""
    SEEN.append((data_source, ground_truth["digit"], extra_info["split"], extra_info.get("num_turns")))
    return {"score": float(len(solution_str) % 3) / 2.0, "tag": extra_info["split"]}


def _planned_batch():
    tensors, nt = rl_batch(5, 3, prompt_len=5, response_len=6, seed=2)
    B = len(nt["uid"])
    nt["data_source"] = np.array(["digits"] * B, dtype=object)
    nt["reward_model"] = np.array([{"ground_truth": {"digit": i % 10}} for i in range(B)], dtype=object)
    nt["extra_info"] = np.array([{"split": "train", "index": i} for i in range(B)], dtype=object)
    nt["__num_turns__"] = np.full(B, 2, dtype=np.int32)
    batch = as_dataproto(tensors, nt)
    fake_trainer().plan_and_apply(batch, dp_size=4)
    assert bool(batch.batch["is_padding"].any())
    return batch


def test_verl_reward_manager_scores_padding_rows_safely(tmp_path):
    from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager

    from verl_traj.cpu.build_tiny import build_tokenizer

    batch = _planned_batch()
    before = [dict(x) for x in batch.non_tensor_batch["extra_info"]]
    manager = NaiveRewardManager(OmegaConf.create({}), build_tokenizer(tmp_path, vocab_size=300, seed=0), reads_everything)
    SEEN.clear()

    async def score_all():
        return [await manager.run_single(batch[i: i + 1]) for i in range(len(batch))]

    out = manager.loop.run_until_complete(score_all())  # the manager runs on its own event loop
    assert len(out) == len(batch) and len(SEEN) == len(batch)  # every row, padding included, was scored
    assert all(s[2] == "train" for s in SEEN)
    pad = batch.batch["is_padding"].numpy()
    real_after = [batch.non_tensor_batch["extra_info"][i] for i in np.flatnonzero(~pad)]
    real_before = [before[i] for i in np.flatnonzero(~pad)]
    # verl's manager writes into extra_info in place: a padding row's copy must not be a real row's dict
    for a, b in zip(real_after, real_before):
        assert a["index"] == b["index"] and a["split"] == b["split"]
    ids = {id(batch.non_tensor_batch["extra_info"][i]) for i in range(len(batch))}
    assert len(ids) == len(batch)


def test_padding_rewards_stop_at_extract_reward_and_never_reach_advantages():
    from verl.trainer.ppo.reward import extract_reward

    batch = _planned_batch()
    pad = batch.batch["is_padding"]
    batch.batch["rm_scores"] = torch.rand(batch.batch["response_mask"].shape)  # a colocated RM scored all rows
    reward, _ = R.reward_on_real_rows(extract_reward)(batch)
    assert torch.all(reward[pad] == 0) and torch.equal(reward[~pad], batch.batch["rm_scores"][~pad])
    with patched(fit_patches(False)):
        reward2, _ = rt.extract_reward(batch)
        assert torch.equal(reward, reward2)
        batch.batch["token_level_scores"] = batch.batch["token_level_rewards"] = reward2
        out = rt.compute_advantage(batch, adv_estimator="grpo", num_repeat=3, config=OmegaConf.create({}))
    assert torch.all(out.batch["advantages"][pad] == 0)


@pytest.mark.parametrize("given_mask", [False, True])
def test_spec_decode_metrics_drop_padding_rows(given_mask):
    drafts, accepts, verifies = np.array([4, 4, 0]), np.array([2, 4, 0]), np.array([2, 2, 0])
    real = np.array([True, True, False])  # the third row is padding (zero counters)
    wrapped = R.spec_decode_on_real_rows(rt.compute_spec_decode_metrics, lambda: real)
    got = wrapped(drafts, accepts, verifies, non_padding_mask=real if given_mask else None)
    assert got["rollout/spec_accept_rate"] == pytest.approx(0.75)  # (0.5 + 1.0) / 2, not / 3
    assert rt.compute_spec_decode_metrics(drafts, accepts, verifies)["rollout/spec_accept_rate"] == pytest.approx(0.5)


def test_rollout_dump_holds_real_rows_only(tmp_path, monkeypatch):
    batch = _planned_batch()
    seen = {}
    tr = fake_trainer()
    monkeypatch.setattr(rt.RayPPOTrainer, "_log_rollout_data",
                        lambda self, b, extra, timing, path: seen.update(rows=len(b), extra=extra))
    tr._log_rollout_data(batch, {"acc": list(range(len(batch)))}, {}, str(tmp_path))
    real = int((~batch.batch["is_padding"]).sum())
    assert seen["rows"] == real and len(seen["extra"]["acc"]) == real
