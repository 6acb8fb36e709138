"""Issue 43, item 4: a group trained on its survivors (``traj.failed_groups=keep_survivors``) gets exactly the
advantages of a group sampled with that many sessions, on rows and on step rows (where a trajectory is several rows),
for every group size from 2 (what the buffer keeps: ``tests/integration/test_v1_group_policies.py``) to n, against
brute-force references. verl's estimators group by ``uid``; the step-wise adapter runs them once per trajectory."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl.trainer.ppo import ray_trainer as rt

from verl_traj.integration.patches.scoped import fit_patches, patched
from verl_traj.testing import as_dataproto, rl_batch

from tests.integration.trainers import fake_trainer

N = 5  # sessions sampled per group
EPS = 1e-6  # verl's epsilon in GRPO's std normalisation


def _brute(name: str, scores: list[float]) -> list[float]:
    """The advantage of each survivor of one group, from the estimator's definition over the survivors."""
    s, k = np.array(scores, dtype=np.float64), len(scores)
    if name == "grpo":
        return list((s - s.mean()) / (s.std(ddof=1) + EPS))
    return list([(s[i] - np.delete(s, i).mean()) for i in range(k)])  # rloo: leave-one-out mean


def _ragged_batch(step_rows: bool, seed: int):
    """Groups of 2..N survivors (uid ``g<k>``), each trajectory 1 row or 2 step rows, a distinct score per
    trajectory on its last row's last response token. Returns the batch and {uid: [score per trajectory]}."""
    rng = np.random.default_rng(seed)
    sizes = list(range(2, N + 1))
    steps = 2 if step_rows else 1
    trajectories = sum(sizes)
    tensors, non_tensors = rl_batch(1, trajectories * steps, seed=seed, steps_per_traj=steps if step_rows else 0)
    uid, traj, step, last, scores = [], [], [], [], {}
    for k in sizes:
        scores[f"g{k}"] = list(rng.normal(size=k).round(3))
        for t in range(k):
            for j in range(steps):
                uid.append(f"g{k}")
                traj.append(f"g{k}_t{t}")
                step.append(j)
                last.append(j == steps - 1)
    reward = torch.zeros_like(tensors["token_level_scores"])
    ends = tensors["response_mask"].cumsum(-1).argmax(-1)  # each row's last loss token
    flat = [s for k in sizes for s in scores[f"g{k}"] for _ in range(steps)]
    for row, (score, is_last) in enumerate(zip(flat, last)):
        if is_last:
            reward[row, ends[row]] = score
    tensors["token_level_scores"], tensors["token_level_rewards"] = reward, reward.clone()
    non_tensors["uid"] = np.array(uid, dtype=object)
    if step_rows:
        non_tensors.update(traj_id=np.array(traj, dtype=object), step_index=np.array(step),
                           is_last_step=np.array(last))
    return as_dataproto(tensors, non_tensors), scores, steps


@pytest.mark.parametrize("name", ["grpo", "rloo"])
@pytest.mark.parametrize("step_rows", [False, True])
def test_a_group_of_k_survivors_gets_the_advantages_of_a_group_of_k(name, step_rows):
    """Planned as the trainer plans it (padding rows, rows reordered), then verl's ``compute_advantage`` as the
    trainer patches it: each real row carries its trajectory's brute-force advantage on every loss token."""
    batch, scores, _ = _ragged_batch(step_rows, seed=3)
    expected = {f"{uid}_t{t}": a for uid, group in scores.items() for t, a in enumerate(_brute(name, group))}
    traj_of_row = (list(batch.non_tensor_batch["traj_id"]) if step_rows
                   else [f"{u}_t{t}" for u, t in zip(batch.non_tensor_batch["uid"], _ranks(batch.non_tensor_batch["uid"]))])
    batch.non_tensor_batch["check_traj"] = np.array(traj_of_row, dtype=object)
    fake_trainer({"step_wise": step_rows}, train_batch_size=len(scores), mini=len(scores), n=N,
                 cap=10_000).plan_and_apply(batch, dp_size=2, metrics={})
    with patched(fit_patches(step_rows)):
        out = rt.compute_advantage(batch, adv_estimator=name, num_repeat=N, config=OmegaConf.create({}))
    adv, mask, pad = out.batch["advantages"], out.batch["response_mask"].bool(), out.batch["is_padding"]
    checked = set()
    for row, traj in enumerate(out.non_tensor_batch["check_traj"]):
        got = adv[row][mask[row]]
        if pad[row]:
            assert torch.all(got == 0)
            continue
        assert torch.allclose(got, torch.full_like(got, expected[traj]), atol=1e-5), (traj, row)
        checked.add(traj)
    assert checked == set(expected)  # every trajectory of every group size 2..N


def _ranks(uid: np.ndarray) -> list[int]:
    """Each row's index within its group (rows path: one row a trajectory)."""
    seen: dict[str, int] = {}
    out = []
    for u in uid:
        out.append(seen.get(u, 0))
        seen[u] = out[-1] + 1
    return out
