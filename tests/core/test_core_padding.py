"""apply_plan: schema kept (shapes, dtypes, 3-D position_ids), minimal padding rows, unique uids."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_traj.testing import random_batch, verl_tensors as to_verl_tensors
from verl_traj.core import PAD_UID_PREFIX, apply_plan, build_layout, plan_mini_batches


def _non_tensors(b):
    B = b.num_rows
    mm = np.empty(B, dtype=object)
    for i in range(B):
        mm[i] = {"pixel_values": i}
    return {
        "uid": b.uid,
        "traj_id": b.traj_id,
        "step_index": b.step_index,
        "is_last_step": b.is_last_step,
        "multi_modal_inputs": mm,
        "raw_prompt": np.array([f"prompt {i}" for i in range(B)], dtype=object),
        "reward_extra": np.arange(B, dtype=np.float32),
    }


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    groups=st.integers(1, 6),
    tpg=st.integers(1, 4),
    steps=st.integers(1, 8),
    dp=st.integers(1, 8),
    M=st.integers(1, 3),
    mrope=st.sampled_from([0, 3]),
    pad_rows=st.integers(0, 2),
)
def test_apply_plan_keeps_schema(seed, groups, tpg, steps, dp, M, mrope, pad_rows):
    b = random_batch(seed, groups, tpg, steps, max_len=64, pad_rows=pad_rows)
    t = to_verl_tensors(b, mrope=mrope)
    nt = _non_tensors(b)
    lay = build_layout(t["attention_mask"], t["response_mask"], b.uid, b.traj_id, b.step_index, b.is_last_step, b.is_padding)
    M = min(M, lay.num_groups)
    plan = plan_mini_batches(lay, M, dp)
    out_t, out_nt = apply_plan(t, nt, plan)
    assert "is_padding" not in out_nt  # a tensor only (verl's to_tensordict refuses a key in both)
    B_out = plan.num_rows
    order = plan.order
    pad = plan.is_padding
    real = ~pad
    P = t["prompts"].shape[1]
    # schema: same keys (+ is_padding, mini_batch_id), same trailing shapes and dtypes
    for k, v in t.items():
        assert out_t[k].shape == (B_out,) + tuple(v.shape[1:]), k
        assert out_t[k].dtype == v.dtype, k
        # real rows gathered unchanged
        assert torch.equal(out_t[k][real], v[order[real]]), k
    assert out_t["is_padding"].dtype == torch.bool and torch.equal(out_t["is_padding"], pad)
    assert out_t["mini_batch_id"].dtype == torch.int64 and torch.equal(out_t["mini_batch_id"], plan.mini_batch_id)
    assert torch.equal(out_t["micro_batch_id"], plan.micro_batch_id)
    assert torch.equal(out_t["traj_index"], plan.traj_index)
    assert torch.equal(out_t["traj_index"][real], lay.traj_index[order[real]])
    for k, v in nt.items():
        assert out_nt[k].shape == (B_out,), k
        assert out_nt[k].dtype == v.dtype or k in ("uid", "traj_id"), k
        assert list(out_nt[k][real.numpy()]) == list(v[order[real].numpy()]), k
    n_pad = int(pad.sum())
    if n_pad:
        am = out_t["attention_mask"][pad]
        assert am.sum(-1).tolist() == [2] * n_pad
        assert (am[:, P - 1] == 1).all() and (am[:, P] == 1).all()
        assert (out_t["response_mask"][pad] == 0).all()
        for k in ("rm_scores", "rollout_log_probs", "routed_experts"):
            assert (out_t[k][pad] == 0).all()
        assert (out_t["input_ids"][pad] == 0).all()
        pos = out_t["position_ids"][pad]
        if mrope:
            assert pos.shape[1:] == (mrope, t["attention_mask"].shape[1])
            pos = pos[:, 0]
        assert pos[:, P - 1].tolist() == [0] * n_pad and pos[:, P].tolist() == [1] * n_pad
        pad_np = pad.numpy()
        uids = out_nt["uid"][pad_np]
        assert all(u.startswith(PAD_UID_PREFIX) for u in uids)
        assert len(set(out_nt["uid"][pad_np])) == n_pad
        assert not set(out_nt["uid"][pad_np]) & set(out_nt["uid"][~pad_np])
        assert len(set(out_nt["traj_id"][pad_np])) == n_pad
        assert not set(out_nt["traj_id"][pad_np]) & set(out_nt["traj_id"][~pad_np])
        assert (out_nt["step_index"][pad_np] == 0).all() and out_nt["is_last_step"][pad_np].all()
        assert all(x == {} for x in out_nt["multi_modal_inputs"][pad_np])
        assert len({id(x) for x in out_nt["multi_modal_inputs"][pad_np]}) == n_pad
        # every other field is a copy of a real row of the same mini-batch (schema-safe for every consumer)
        mb = plan.mini_batch_id.numpy()
        for row in np.flatnonzero(pad_np):
            donors = {out_nt["raw_prompt"][j] for j in np.flatnonzero(~pad_np & (mb == mb[row]))}
            assert out_nt["raw_prompt"][row] in donors
        assert (out_nt["reward_extra"][pad_np] == 0).all()  # numeric fields: 0, neutral in any sum
    # the padded batch is itself a valid layout with the plan's padding flagged: re-planning works
    lay2 = build_layout(
        out_t["attention_mask"], out_t["response_mask"], out_nt["uid"], out_nt["traj_id"], out_nt["step_index"],
        out_nt["is_last_step"], out_t["is_padding"],
    )
    assert lay2.num_real_rows == int(real.sum())
    assert int(lay2.num_loss_tokens[out_t["is_padding"]].sum()) == 0


def test_prompt_length_without_prompts_tensor():
    b = random_batch(0, 3, 1, 1, max_len=16)
    t = to_verl_tensors(b)
    P = t.pop("prompts").shape[1]
    t.pop("responses")
    lay = build_layout(t["attention_mask"], t["response_mask"], b.uid)
    plan = plan_mini_batches(lay, 1, 4)
    assert plan.is_padding.any()
    out, _ = apply_plan(t, {"uid": b.uid}, plan, prompt_length=P)
    assert (out["attention_mask"][plan.is_padding][:, P - 1 : P + 1] == 1).all()
    out2, _ = apply_plan(t, {"uid": b.uid}, plan)  # fallback L - R
    assert torch.equal(out["attention_mask"], out2["attention_mask"])


def test_integer_uids_get_fresh_ids():
    b = random_batch(0, 3, 1, 1, max_len=16)
    t = to_verl_tensors(b)
    lay = build_layout(t["attention_mask"], t["response_mask"], b.uid)
    plan = plan_mini_batches(lay, 1, 4)
    _, nt = apply_plan(t, {"uid": np.arange(3) * 10}, plan)
    assert len(set(nt["uid"].tolist())) == nt["uid"].shape[0]


def test_row_count_mismatch_raises():
    b = random_batch(0, 3, 1, 1, max_len=16)
    t = to_verl_tensors(b)
    lay = build_layout(t["attention_mask"], t["response_mask"], b.uid)
    plan = plan_mini_batches(lay, 1, 2)
    with pytest.raises(ValueError, match="rows but the plan was built for"):
        apply_plan({"attention_mask": t["attention_mask"][:2]}, {}, plan)


def _grpo_scores(uid: np.ndarray, score: torch.Tensor) -> dict:
    """GRPO outcome normalisation as verl does it: per-uid mean / std of the sequence scores."""
    out = {}
    for u in set(uid.tolist()):
        sel = torch.from_numpy(uid == u)
        s = score[sel]
        out[u] = (float(s.mean()), float(s.std()) if s.numel() > 1 else 1.0, int(sel.sum()))
    return out


def test_padding_changes_no_group_statistic_or_token_sum():
    b = random_batch(11, 5, 4, 6, max_len=48)
    t = to_verl_tensors(b)
    t["token_level_scores"] = torch.rand(t["response_mask"].shape) * t["response_mask"]
    lay = build_layout(t["attention_mask"], t["response_mask"], b.uid, b.traj_id, b.step_index)
    plan = plan_mini_batches(lay, 3, 8)
    assert plan.is_padding.any()
    out_t, out_nt = apply_plan(t, {"uid": b.uid}, plan)
    before = _grpo_scores(b.uid, t["token_level_scores"].sum(-1))
    after = _grpo_scores(out_nt["uid"], out_t["token_level_scores"].sum(-1))
    pad_uids = set(out_nt["uid"][plan.is_padding.numpy()].tolist())
    real_after = {k: v for k, v in after.items() if k not in pad_uids}
    assert real_after.keys() == before.keys()
    for k, (mean, std, n) in before.items():
        assert real_after[k][2] == n
        assert real_after[k][:2] == pytest.approx((mean, std), rel=1e-5)
    assert all(after[u][2] == 1 and after[u][0] == 0.0 for u in pad_uids)  # groups of one, zero score
    # masked token sums (any loss aggregation) are unchanged
    for key in ("token_level_scores", "rollout_log_probs", "rm_scores"):
        s0 = (t[key] * t["response_mask"]).sum()
        s1 = (out_t[key] * out_t["response_mask"]).sum()
        assert torch.allclose(s0, s1)
    assert int(out_t["response_mask"].sum()) == int(t["response_mask"].sum())
