"""KL-in-reward on verl's v1 trainer sees real rows only (issue 40, item 6).

v1's ``trainer_base`` imports ``apply_kl_penalty`` by name, so v0's patch of ``ray_trainer.apply_kl_penalty`` never
reached it: the adaptive KL controller saw the KL shrunk by real / all rows and counted padding rows as steps. Here
the v1 trainer is built by its real ``__init__`` (:func:`~verl_traj.testing.trainers.ray_less_trainer`) with
``algorithm.use_kl_in_reward=true`` and an adaptive controller, its real ``_balance_batch`` plans (and pads) the
rows, and verl's own ``_compute_advantage`` runs twice (two controller updates): the stored token-level rewards of
the real rows, ``actor/reward_kl_penalty{,_coeff}`` and the controller's value equal those of the same rows planned
for one rank (no padding row).

TransferQueue lies across a process boundary, so it is stood in for by :class:`RowStore`: rows held in this process,
a get built by verl's own ``list_of_dict_to_tensordict`` (the TensorDict a real TransferQueue get returns for these
fields: nested per-token tensors, ``uid`` a non-tensor stack; checked against a real one when this test was
written).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict

from verl_traj.config import TrajConfig
from verl_traj.integration.config.verl_config import PlanSettings
from verl_traj.testing.trainers import ray_less_trainer

MINI, N, PROMPTS = 2, 3, 4  # 4 prompts x 3 sessions x 1-3 steps, mini-batches of 2 prompts
KL = {"use_kl_in_reward": True, "kl_penalty": "kl",
      "kl_ctrl": {"type": "adaptive", "kl_coef": 0.1, "target_kl": 0.03, "horizon": 100}}


class RowStore:
    """TransferQueue's ``kv_batch_get`` / ``kv_batch_put`` over rows held in this process (module docstring)."""

    def __init__(self) -> None:
        self.rows: dict[str, dict] = {}
        self.tags: dict[str, dict] = {}

    def kv_batch_put(self, keys, partition_id, fields=None, tags=None, data_parser=None):
        from transfer_queue import KVBatchMeta

        if fields is not None:
            cols = {f: (v.unbind(0) if isinstance(v, torch.Tensor) else v.tolist())
                    for f, v in ((f, fields.get(f)) for f in fields.keys())}
            for i, key in enumerate(keys):
                self.rows.setdefault(key, {}).update({f: col[i] for f, col in cols.items()})
        for key, tag in zip(keys, tags or []):
            self.tags[key] = tag
        return KVBatchMeta(keys=list(keys), tags=[self.tags.get(k, {}) for k in keys], partition_id=partition_id)

    def kv_batch_get(self, keys, partition_id, select_fields=None):
        from verl.utils.tensordict_utils import list_of_dict_to_tensordict

        keys = [keys] if isinstance(keys, str) else keys
        common = set.intersection(*(set(self.rows[k]) for k in keys))  # a get returns the fields every row has
        names = [f for f in (select_fields or sorted(common)) if f in common]
        return list_of_dict_to_tensordict([{f: self.rows[k][f] for f in names} for k in keys])


def _rows(seed: int) -> tuple[list[str], list[dict], list[dict], dict]:
    """Agent-loop rows as ``AgentLoopWorkerTQ`` stores them, and each row's (old, ref) log-probs by key (written after
    planning, as the log-prob passes write them)."""
    rng = np.random.default_rng(seed)
    keys, rows, tags, log_probs = [], [], [], {}
    for g in range(PROMPTS):
        for s in range(N):
            for k in range(int(rng.integers(1, 4))):
                p, r = int(rng.integers(3, 9)), int(rng.integers(2, 7))
                mask = torch.ones(r, dtype=torch.int64)
                mask[: int(rng.integers(0, r))] = 0
                ids = torch.randint(3, 50, (p + r,))
                keys.append(f"u{g}_{s}_{k}")
                rows.append({"prompts": ids[:p], "responses": ids[p:], "input_ids": ids, "response_mask": mask,
                             "loss_mask": mask, "position_ids": torch.arange(p + r), "uid": f"u{g}", "session_id": s,
                             "rm_scores": torch.nn.functional.one_hot(torch.tensor(r - 1), r).float() * rng.random(),
                             "num_turns": 2})
                tags.append({"status": "success", "prompt_len": p, "response_len": r, "seq_len": p + r,
                             "global_steps": 1, "min_global_steps": 0, "max_global_steps": 0})
                old = -torch.from_numpy(rng.random(r)).float()
                log_probs[keys[-1]] = (old, old - torch.from_numpy(rng.uniform(0.02, 0.04, r)).float())
    return keys, rows, tags, log_probs


def _run(monkeypatch, dp: int, steps: int = 2, seed: int = 3) -> dict:
    """The rows planned for ``dp`` ranks, then ``steps`` of v1's ``_compute_advantage``: per step the KL metrics and
    the controller's value, and the stored token-level rewards and advantages by key."""
    import transfer_queue
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    store = RowStore()
    monkeypatch.setattr(transfer_queue, "kv_batch_get", store.kv_batch_get)
    monkeypatch.setattr(transfer_queue, "kv_batch_put", store.kv_batch_put)
    keys, rows, tags, log_probs = _rows(seed)
    transfer_queue.kv_batch_put(keys, "train", list_of_dict_to_tensordict(rows), tags)
    config = OmegaConf.create({"data": {"train_batch_size": PROMPTS, "max_response_length": 8},
                               "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": MINI, "ppo_epochs": 1}},
                               "algorithm": KL})
    tr = ray_less_trainer(config, TrajConfig(), dp=dp, v1_class=PPOTrainerSync,
                          plan=PlanSettings(max_tokens=24, cost="tokens", derived=True, pad_row_tokens=2))
    batch = tr._balance_batch(KVBatchMeta(keys=list(keys), tags=list(tags), partition_id="train"), {})
    pad = tr._step_facts.current.is_padding
    # the log-prob passes write every row, padding rows included (a 1-token forward: some log-prob, masked out)
    fields = [log_probs.get(k, (torch.tensor([-0.7]), torch.tensor([-0.2]))) for k in batch.keys]
    transfer_queue.kv_batch_put(batch.keys, "train", TensorDict({
        "old_log_probs": torch.nested.nested_tensor([f[0] for f in fields], layout=torch.jagged),
        "ref_log_prob": torch.nested.nested_tensor([f[1] for f in fields], layout=torch.jagged)},
        batch_size=[len(batch)]))
    out = {"padding_rows": int(pad.sum()), "steps": []}
    for _ in range(steps):
        metrics = {}
        tr._compute_advantage(batch, metrics)
        stored = transfer_queue.kv_batch_get(batch.keys, "train", ["token_level_rewards", "advantages"])
        out["steps"].append((metrics["actor/reward_kl_penalty"], metrics["actor/reward_kl_penalty_coeff"],
                             tr.kl_ctrl_in_reward.value,
                             dict(zip(batch.keys, stored["token_level_rewards"].unbind(0))),
                             dict(zip(batch.keys, stored["advantages"].unbind(0)))))
    out["padding_keys"] = [k for k, p in zip(batch.keys, pad.tolist()) if p]
    return out


def test_v1_kl_in_reward_and_its_controller_see_real_rows_only(monkeypatch):
    from verl.trainer.ppo import ray_trainer
    from verl.trainer.ppo.v1 import trainer_base

    padded, single = _run(monkeypatch, dp=2), _run(monkeypatch, dp=1)
    assert padded["padding_rows"] > 0 and single["padding_rows"] == 0  # the defect needs padding rows to show
    for step, step1 in zip(padded["steps"], single["steps"]):
        (kl, coeff, value, rewards, adv), (kl1, coeff1, value1, rewards1, adv1) = step, step1
        assert kl == pytest.approx(kl1, rel=1e-6) and coeff == pytest.approx(coeff1, rel=1e-6)
        assert value == pytest.approx(value1, rel=1e-6)  # the adaptive controller's update: real KL, real row count
        for key, reward in rewards1.items():  # the second step's rewards use the updated coefficient
            torch.testing.assert_close(rewards[key], reward)
            torch.testing.assert_close(adv[key], adv1[key])
        for key in padded["padding_keys"]:  # a padding row's reward stays its (zero) score
            assert torch.count_nonzero(rewards[key]) == 0 and torch.count_nonzero(adv[key]) == 0
    assert padded["steps"][0][2] != padded["steps"][1][2]  # the controller moved: step 2 tests the update
    assert trainer_base.apply_kl_penalty is ray_trainer.apply_kl_penalty  # restored after each call


def test_every_v1_mode_computes_its_advantage_in_trainer_base():
    """The patch of ``trainer_base.apply_kl_penalty`` reaches every registered mode: each runs ``PPOTrainer``'s own
    ``_compute_advantage`` (verl's ``experimental/separation/ray_trainer.py``, which imports ``apply_kl_penalty`` too,
    is a v0 ``RayPPOTrainer`` for verl's fully-async / one-step-off recipes, which verl_traj does not run)."""
    from verl.experimental.separation.ray_trainer import SeparateRayPPOTrainer
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, PPOTrainer

    for name, cls in TRAINER_REGISTRY.items():
        assert cls._compute_advantage is PPOTrainer._compute_advantage, name
        assert not issubclass(cls, SeparateRayPPOTrainer), name
