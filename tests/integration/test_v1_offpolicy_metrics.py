"""The v1 trainer's per-step off-policy read (:func:`~verl_traj.integration.trainers.v1_metrics.offpolicy_metrics`)
over an in-memory stand-in for TransferQueue's ``kv_batch_get``: under the row budget it reads every real row and its
figures are the brute-force ones; over it, a seeded sample of whole trajectories within the budget, the lag and the
off-policy trajectory count still over every row."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transfer_queue import KVBatchMeta

from verl_traj.core.rollout.offpolicy import lag_stats, weight_health
from verl_traj.core.rollout.session_ledger import VERSION_TOKENS_TAG
from verl_traj.integration.trainers import v1_metrics
from verl_traj.integration.trainers.v1_metrics import offpolicy_metrics

STEP, R = 10, 6  # global step (the trained policy is version 9), response length


def _batch(trajectories: int, rows_each: int, seed: int = 0):
    """``trajectories`` of ``rows_each`` rows (every third one off-policy: version 9 - lag), a padding row, and the
    stored fields by key."""
    rng, keys, tags, store = np.random.default_rng(seed), [], [], {}
    for t in range(trajectories):
        lag = (t % 3 == 0) * (1 + t % 4)
        for step in range(rows_each):
            key = f"g{t // 2}_{t % 2}_{step}"
            keys.append(key)
            tags.append({"min_global_steps": STEP - 1 - lag, "max_global_steps": STEP - 1,
                         VERSION_TOKENS_TAG: [[STEP - 1 - lag, 3], [STEP - 1, 2]] if lag else [[STEP - 1, 5]]})
            mask = (torch.arange(R) < int(rng.integers(1, R + 1))).long()
            rollout = torch.from_numpy(-rng.random(R)).float()
            store[key] = (rollout + 0.1 * lag * torch.from_numpy(rng.standard_normal(R)).float(), rollout, mask)
    keys.append("pad0_0_0")
    tags.append({"is_padding": True})
    return KVBatchMeta(keys=keys, tags=tags, partition_id="train"), store


@pytest.fixture
def reads(monkeypatch):
    """Each ``kv_batch_get``'s keys; the fields come from the store the test puts in ``reads.store``."""
    log = SimpleNamespace(keys=[], store={})

    def kv_batch_get(keys, partition_id, select_fields):
        log.keys.append(list(keys))
        fields = dict(zip(("old_log_probs", "rollout_log_probs", "response_mask"), zip(*(log.store[k] for k in keys))))
        return {name: torch.stack(fields[name]) for name in select_fields}

    monkeypatch.setattr(v1_metrics, "tq", SimpleNamespace(kv_batch_get=kv_batch_get))
    return log


def _expected(batch, store, keys, truncation=2.0):
    """Brute force over the rows of ``keys`` (whole trajectories): their weight health, and the lag and the count of
    off-policy trajectories over every real row."""
    real = [i for i, t in enumerate(batch.tags) if not t.get("is_padding")]
    traj = {batch.keys[i].rsplit("_", 1)[0] for i in real if batch.tags[i]["min_global_steps"] < STEP - 1}
    old, rollout, mask = (torch.stack(f).float() for f in zip(*(store[k] for k in keys)))
    off = torch.tensor([k.rsplit("_", 1)[0] in traj for k in keys])[:, None] & mask.bool()
    log_ratio = old - rollout
    return {**weight_health(log_ratio, off, truncation), **weight_health(log_ratio, mask.bool(), truncation, "_all"),
            **lag_stats([batch.tags[i][VERSION_TOKENS_TAG] for i in real], STEP - 1),
            "traj_offpolicy/trajectories": float(len(traj)), "traj_offpolicy/rows_read": float(len(keys))}


def test_under_the_budget_every_real_row_is_read_once_and_the_figures_are_exact(reads):
    batch, reads.store = _batch(trajectories=7, rows_each=3)
    out = offpolicy_metrics(batch, STEP, 2.0)
    assert reads.keys == [batch.keys[:-1]]  # every real row, in batch order; not the padding row
    expected = _expected(batch, reads.store, batch.keys[:-1])
    assert {k: out[k] for k in expected} == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert out["traj_version/current_policy_rows"] == 4 * 3  # trajectories 1, 2, 4, 5 are of the current policy
    assert "traj_bias/tokens_mean_ratio_weighted" in out


def test_over_the_budget_the_read_is_a_seeded_sample_of_whole_trajectories(reads, monkeypatch):
    monkeypatch.setattr(v1_metrics, "OFFPOLICY_READ_ROWS", 8)
    batch, reads.store = _batch(trajectories=20, rows_each=3)  # 60 real rows, budget 8: two trajectories a step
    out = offpolicy_metrics(batch, STEP, 2.0)
    (read,) = reads.keys
    assert len(read) == 6 and out["traj_offpolicy/rows_read"] == 6
    chosen = {k.rsplit("_", 1)[0] for k in read}
    assert sorted(read) == sorted(k for k in batch.keys if k.rsplit("_", 1)[0] in chosen)  # whole trajectories
    expected = _expected(batch, reads.store, read)
    assert {k: out[k] for k in expected} == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert out["traj_offpolicy/trajectories"] == 7 and out["traj_offpolicy/lag_max"] == 4  # from every row's tags
    assert offpolicy_metrics(batch, STEP, 2.0) == out and reads.keys[1] == read  # same step: same sample
    others = {tuple(reads.keys[-1]) for step in range(STEP + 1, STEP + 9) if offpolicy_metrics(batch, step, 2.0)}
    assert len(others | {tuple(read)}) > 1  # another step, another sample


def test_without_truncation_only_the_current_policys_rows_are_read_within_the_budget(reads, monkeypatch):
    monkeypatch.setattr(v1_metrics, "OFFPOLICY_READ_ROWS", 8)
    batch, reads.store = _batch(trajectories=20, rows_each=3)
    out = offpolicy_metrics(batch, STEP, None)
    (read,) = reads.keys
    assert len(read) == 6 and all(batch.tags[batch.keys.index(k)]["min_global_steps"] == STEP - 1 for k in read)
    assert out["traj_version/current_policy_rows"] == 6 and not any(k.startswith("traj_offpolicy/") for k in out)
    monkeypatch.setattr(v1_metrics, "OFFPOLICY_READ_ROWS", 4096)
    offpolicy_metrics(batch, STEP, None)
    assert len(reads.keys[-1]) == 13 * 3  # under the budget: every current-policy row, as before
